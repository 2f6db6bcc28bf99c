"""Request state in a real Redis: fenced commits, TTLs on every key."""

import redis.asyncio as aioredis
import pytest

from cosine.common.state import RequestStore, StaleCommit, req_key, tokens_key


@pytest.fixture
async def store(redis_server):
    client = aioredis.from_url(redis_server)
    yield RequestStore(client, ttl_s=100, finished_ttl_s=50)
    await client.aclose()


async def test_commit_is_fenced_by_step(store):
    assert await store.create("s1", [1, 2, 3], {"temperature": 0}, {"max_new_tokens": 8})
    step = await store.commit("s1", 0, [4, 5], drafted=3, accepted=1)
    assert step == 1
    with pytest.raises(StaleCommit):
        await store.commit("s1", 0, [9], drafted=0, accepted=0)  # a replayed round changes nothing
    step = await store.commit("s1", step, [6], drafted=2, accepted=0)
    state = await store.load("s1")
    assert state.token_ids == [4, 5, 6] and state.step == 2 and state.rounds == 2
    assert (state.drafted, state.accepted) == (5, 1)
    assert state.prompt_token_ids == [1, 2, 3]


async def test_policy_state_rides_on_the_commit(store):
    assert await store.create("p1", [1], {}, {})
    step = await store.commit("p1", 0, [2], 0, 0, policy={"routing": {"scores": [0.5]}})
    assert (await store.load("p1")).policy == {"routing": {"scores": [0.5]}}
    step = await store.commit("p1", step, [3], 0, 0)  # a commit without policy keeps the last one
    assert (await store.load("p1")).policy == {"routing": {"scores": [0.5]}}
    with pytest.raises(StaleCommit):
        await store.commit("p1", 0, [9], 0, 0, policy={"routing": "stale"})  # fenced off: nothing written
    state = await store.load("p1")
    assert state.policy == {"routing": {"scores": [0.5]}} and state.token_ids == [2, 3]
    assert await store.create("p2", [1], {}, {})
    assert (await store.load("p2")).policy is None


async def test_every_key_has_a_ttl(store):
    await store.create("s2", [1], {}, {})
    await store.commit("s2", 0, [7], 0, 0)
    for key in (req_key("s2"), tokens_key("s2")):
        assert 0 < await store.client.ttl(key) <= 100
    await store.finish("s2", "cancelled")
    for key in (req_key("s2"), tokens_key("s2")):
        assert 0 < await store.client.ttl(key) <= 50
    assert (await store.load("s2")).status == "cancelled"


async def test_running_ids_are_unique_but_ended_ones_can_be_reused(store):
    assert await store.create("s3", [1], {}, {})
    assert not await store.create("s3", [2], {}, {})
    await store.finish("s3", "finished")
    assert await store.create("s3", [2], {}, {})
    assert (await store.load("s3")).token_ids == []


async def test_keys_share_a_cluster_slot():
    assert req_key("abc").split("}")[0] == tokens_key("abc").split("}")[0] == "cosine:{abc"


async def test_a_take_over_fences_the_old_owner(store):
    epoch = await store.create("t1", [1, 2], {"seed": 7}, {"max_new_tokens": 8})
    assert epoch == 1
    step = await store.commit("t1", 0, [3], 1, 0, epoch=epoch)
    state = await store.take_over("t1")  # the new owner: tokens, sampling (seed) and step as committed
    assert state.epoch == 2 and state.status == "running"
    assert state.token_ids == [3] and state.step == step and state.sampling == {"seed": 7}
    with pytest.raises(StaleCommit):  # the old owner, still running, can no longer commit ...
        await store.commit("t1", step, [9], 0, 0, epoch=epoch)
    assert await store.renew_many([("t1", epoch), ("t1", state.epoch)]) == [False, True]  # ... nor renew ...
    assert not await store.finish("t1", "failed", epoch=epoch)  # ... nor end it
    await store.commit("t1", step, [4], 0, 0, epoch=state.epoch)
    assert await store.finish("t1", "finished", "FINISH_REASON_LENGTH", epoch=state.epoch)
    done = await store.load("t1")
    assert done.token_ids == [3, 4] and done.status == "finished" and done.finish_reason == "FINISH_REASON_LENGTH"
    assert (await store.take_over("t1")).status == "finished"  # an ended request is not taken over
    assert (await store.load("t1")).epoch == 2
    assert await store.take_over("nothing-here") is None


async def test_a_running_request_whose_owner_died_can_be_created_again_at_once(redis_server):
    client = aioredis.from_url(redis_server)
    try:
        store = RequestStore(client, ttl_s=100, finished_ttl_s=50, lease_s=0.3)
        first = await store.create("t2", [1], {}, {})
        assert first and not await store.create("t2", [1], {}, {})  # its owner's lease is alive: refused
        assert await store.renew_many([("t2", first)]) == [True]
        import asyncio
        await asyncio.sleep(0.4)  # the owner died: nobody renewed the lease
        second = await store.create("t2", [5], {}, {})
        assert second == first + 1
        with pytest.raises(StaleCommit):  # the old owner, if it still runs, is fenced off
            await store.commit("t2", 0, [9], 0, 0, epoch=first)
        assert (await store.load("t2")).prompt_token_ids == [5]
    finally:
        await client.aclose()


async def _calls(client, command: str) -> int:
    return int((await client.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_commit_many_sends_only_the_commits_fenced_and_survives_a_flushed_script_cache(store):
    epochs = {rid: await store.create(rid, [1, 2], {}, {}) for rid in ("m0", "m1", "m2")}
    assert await store.commit_many([("m0", 0, [1], 0, 0, None)]) == [None]  # the first loads the script
    exists, evalsha = await _calls(store.client, "script|exists"), await _calls(store.client, "evalsha")
    out = await store.commit_many([("m1", 0, [3], 1, 0, None), ("m2", 0, [4, 5], 2, 1, None)])
    assert out == [None, None]
    # one pipeline of the two commits: no "is the script loaded?" round trip before them
    assert await _calls(store.client, "script|exists") == exists
    assert await _calls(store.client, "evalsha") == evalsha + 2
    out = await store.commit_many([("m1", 0, [9], 0, 0, None), ("m2", 1, [6], 0, 0, None)])
    assert isinstance(out[0], StaleCommit) and out[1] is None  # each round fenced on its own
    await store.client.script_flush()  # as after a Redis restart: the next commits load the script again
    assert await store.commit_many([("m1", 1, [7], 0, 0, None)]) == [None]
    await store.client.script_flush()
    assert await store.renew_many([("m1", epochs["m1"]), ("m2", epochs["m2"] + 1)]) == [True, False]
    assert (await store.load("m1")).token_ids == [3, 7]
    assert (await store.load("m2")).token_ids == [4, 5, 6]
