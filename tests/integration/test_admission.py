"""Admission and fencing: more streams than slots get RESOURCE_EXHAUSTED at once while admitted ones are
undisturbed; full drafters only cost speculation; a request id open in an engine is never taken over;
a request without a client deadline gets the router's; messages name no internal address."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.router.v1 import router_pb2, router_pb2_grpc
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from tests.faults.conftest import assert_no_address, generate, greedy  # noqa: F401 - greedy is a fixture
from tests.integration.conftest import start_services, stop_services

SLOTS = 4
PROMPT = "Once upon a time, in a land"


@pytest.fixture(scope="module")
async def small(tiny_dirs, redis_server):
    """Verifier with 4 slots, a router admitting 4 streams, drafters with 2 KV slots each."""
    services = await start_services(tiny_dirs, redis_server, max_slots=SLOTS, max_streams=SLOTS, max_requests=2)
    yield services
    await stop_services(services)


async def timed(stub, prompt: str, n: int, **fields):
    """(code, token ids, seconds to the first message or the error)."""
    started = time.perf_counter()
    first = None
    ids = []
    try:
        async for reply in stub.Generate(router_pb2.GenerateRequest(prompt=prompt.encode(), max_new_tokens=n, **fields), timeout=60):
            first = first or time.perf_counter() - started
            if reply.WhichOneof("kind") == "chunk":
                ids += reply.chunk.token_ids
    except grpc.aio.AioRpcError as exc:
        return exc.code(), ids, time.perf_counter() - started, exc.details()
    return grpc.StatusCode.OK, ids, first, ""


async def test_more_streams_than_slots_are_ok_or_resource_exhausted_at_once(small, greedy):
    prompts = [f"{PROMPT} {i}" for i in range(3 * SLOTS)]
    async with grpc.aio.insecure_channel(small.router) as channel:
        await channel.channel_ready()
        stub = router_pb2_grpc.RouterStub(channel)
        results = await asyncio.gather(*(timed(stub, p, 64) for p in prompts))
    codes = [r[0] for r in results]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= SLOTS  # every slot was used
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= len(prompts) - 2 * SLOTS  # the excess was refused
    for prompt, (code, ids, seconds, details) in zip(prompts, results):
        if code == grpc.StatusCode.OK:
            assert ids == greedy(prompt, 64)  # admitted streams are undisturbed
        else:
            assert seconds < 0.1, f"refused after {seconds * 1000:.0f} ms"
            assert "retry later" in details


async def test_full_drafters_cost_speculation_not_requests(small, greedy):
    # 4 streams, drafters with 2 slots: two requests draft, the others decode plainly; all identical
    prompts = [f"a b c a b c {i}" for i in range(SLOTS)]
    full = small["fusion"].servicer.metrics.dropped.labels("tiny", "full")
    before = full._value.get()
    results = await asyncio.gather(*(generate(small.router, p, 48, speculation={"drafters": ["tiny"]}) for p in prompts))
    for prompt, (ids, final, err) in zip(prompts, results):
        assert err is None, err
        assert ids == greedy(prompt, 48)
    assert full._value.get() > before  # the drafter was full for some of them
    assert small["fusion"].servicer.health.usable("tiny")  # and being full is not a failure


async def test_an_open_request_id_is_never_taken_over(small):
    verifier = f"127.0.0.1:{small['verifier'].port}"
    drafter = f"127.0.0.1:{small['drafter-tiny'].port}"
    async with grpc.aio.insecure_channel(verifier) as vch, grpc.aio.insecure_channel(drafter) as dch:
        vstub, dstub = verifier_pb2_grpc.VerifierStub(vch), drafter_pb2_grpc.DrafterStub(dch)
        opening = verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(request_id="dup", committed_token_ids=[1, 2, 3], prompt_len=3))
        first = vstub.Verify(timeout=30)
        await first.write(opening)
        plain = verifier_pb2.VerifyRequest(round=verifier_pb2.VerifyRound(tree=common_pb2.DraftTree()))
        await first.write(plain)
        before = await first.read()
        second = vstub.Verify(timeout=30)
        await second.write(opening)
        await second.write(plain)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await second.read()
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await first.write(plain)  # the first stream's cache is untouched: it goes on
        after = await first.read()
        assert len(before.token_ids) == len(after.token_ids) == 1
        first.cancel()

        dopen = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(request_id="dup", prompt_token_ids=[5, 6, 7, 5, 6]))
        step = drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(depth=2))
        d1 = dstub.Draft(timeout=30)
        await d1.write(dopen)
        await d1.write(step)
        proposal = await d1.read()
        d2 = dstub.Draft(timeout=30)
        await d2.write(dopen)
        await d2.write(step)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await d2.read()
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        await d1.write(drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(depth=2)))
        again = await d1.read()  # same context, same proposal: nothing of d1's was released
        assert list(again.token_ids) == list(proposal.token_ids)
        d1.cancel()
        # once the holder ended, the id can be opened again
        for _ in range(50):
            d3 = dstub.Draft(timeout=30)
            await d3.write(dopen)
            await d3.write(step)
            try:
                await d3.read()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the id stayed taken after its stream ended")
        d3.cancel()


async def test_the_router_sets_a_deadline_when_the_client_sets_none(small):
    router = small["router"].servicer
    saved, router.default_timeout_s = router.default_timeout_s, 0.05
    try:
        async with grpc.aio.insecure_channel(small.router) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
                        prompt=PROMPT.encode(), max_new_tokens=256, speculation={"disabled": True})):  # no client deadline
                    pass
    finally:
        router.default_timeout_s = saved
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "default" in ended.value.details()


async def test_an_unreachable_scheduler_is_unavailable_without_its_address(small, tiny_dirs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    router = await serve_router(RouterSettings(port=0, scheduler=f"127.0.0.1:{dead}", fusion=f"127.0.0.1:{small['fusion'].port}",
                                               model=str(tiny_dirs["target"]), drain_timeout_s=0.5))
    try:
        _, _, err = await generate(f"127.0.0.1:{router.port}", PROMPT, 8)
    finally:
        await router.stop()
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert_no_address(err.details())
    assert str(dead) not in err.details()
