"""Every combination of the mechanisms' switches, through real services: greedy output never changes.

Fusion (confidence / merge / single) x adaptive depth (on / off) x expertise routing (on / off) x
pipelining (drafting ahead, on / off),
per request, on the in-process cluster of tiny random models; plus a scheduler whose switches
come from its settings (COSINE_SCHEDULER_SWITCHES).
"""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from cosine.common.v1 import common_pb2
from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.fusion.__main__ import FusionSettings
from cosine.fusion.__main__ import serve as serve_fusion
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from cosine.scheduler.__main__ import SchedulerSettings
from cosine.scheduler.__main__ import serve as serve_scheduler
from tests.integration.test_metrics import scrape_all, value
from tests.integration.test_services import PROMPTS, generate, no_eos, reference  # noqa: F401 - reference is a fixture

FUSION = {"confidence": common_pb2.FUSION_MODE_CONFIDENCE, "merge": common_pb2.FUSION_MODE_MERGE,
          "single": common_pb2.FUSION_MODE_SINGLE}
PROMPTS3 = [PROMPTS[0], PROMPTS[1], PROMPTS[3], "a b c a b c a b"]
N = 32
COMBINATIONS = list(itertools.product(FUSION, (True, False), (True, False), (True, False)))


@pytest.fixture(scope="module")
async def plain(services):
    """Each prompt decoded by the target alone, through the cluster (speculation disabled)."""
    out = {}
    for prompt in PROMPTS3:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={"disabled": True})
        assert final.stats.drafted_tokens == 0
        out[prompt] = ids
    return out


@pytest.mark.parametrize("fusion,adaptive,routing,pipelining", COMBINATIONS)
async def test_greedy_output_is_the_targets_under_every_switch(services, reference, plain, fusion, adaptive, routing,  # noqa: F811
                                                               pipelining):
    before = (await scrape_all(services))["fusion"]
    drafted = 0
    for prompt in PROMPTS3:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={
            "fusion": FUSION[fusion], "adaptive_depth": adaptive, "routing": routing, "pipelining": pipelining})
        assert ids == plain[prompt] == no_eos(reference(prompt, N)), (prompt, fusion, adaptive, routing, pipelining)
        drafted += final.stats.drafted_tokens
        used = list(final.stats.drafters)
        if not routing:
            assert used in ([], ["ngram"]), used  # the fixed drafter: the router's first default
        else:  # routing starts with what the prompt prior ranks first, then may add or explore the other
            # candidate; how many it exploits is the global controller's, which moves with the verifier's load
            assert set(used) <= {"ngram", "tiny"}, used
    assert drafted > 0
    after = (await scrape_all(services))["fusion"]
    moved = (value(after, "cosine_fusion_rounds_total", mode=fusion) or 0) - (value(before, "cosine_fusion_rounds_total", mode=fusion) or 0)
    assert moved > 0, f"fusion ran no {fusion} round"


async def test_every_combination_at_once(services, plain):
    """Requests with different switches in flight together: the verifier batches their different trees."""
    # 12 in flight, within the verifier's and the drafters' 16 KV slots
    jobs = [(PROMPTS3[i % len(PROMPTS3)], combo) for i, combo in enumerate(COMBINATIONS[::2])]
    results = await asyncio.gather(*(
        generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={
            "fusion": FUSION[fusion], "adaptive_depth": adaptive, "routing": routing, "pipelining": pipelining})
        for prompt, (fusion, adaptive, routing, pipelining) in jobs))
    for (prompt, combo), (ids, _, _) in zip(jobs, results):
        assert ids == plain[prompt], (prompt, combo)


@pytest.mark.parametrize("fusion", list(FUSION))
async def test_named_drafters_under_every_fusion_mode(services, reference, fusion):  # noqa: F811
    for prompt in PROMPTS3[:2]:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={
            "drafters": ["tiny", "ngram"], "fusion": FUSION[fusion], "adaptive_depth": False, "max_depth": 3})
        assert ids == no_eos(reference(prompt, N))
        assert list(final.stats.drafters) == (["tiny"] if fusion == "single" else ["tiny", "ngram"])
        assert final.stats.drafted_tokens > 0


async def test_a_scheduler_configured_with_switches(services, reference, redis_server, tiny_dirs, monkeypatch):  # noqa: F811
    """COSINE_SCHEDULER_SWITCHES sets the server's switches; requests that say nothing run under them."""
    monkeypatch.setenv("COSINE_SCHEDULER_SWITCHES", "routing=off,fusion=single,adaptive_depth=off,fixed_depth=2")
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0}
    scheduler = await serve_scheduler(SchedulerSettings(
        verifier=f"127.0.0.1:{services['verifier'].port}", fusion=f"127.0.0.1:{services['fusion'].port}",
        redis_url=redis_server, startup_timeout_s=30, **common))
    router = None
    try:
        sw = scheduler.servicer.config.switches
        assert (sw.routing, sw.fusion, sw.adaptive_depth, sw.fixed_depth) == (False, "single", False, 2)
        router = await serve_router(RouterSettings(
            scheduler=f"127.0.0.1:{scheduler.port}", fusion=f"127.0.0.1:{services['fusion'].port}",
            model=str(tiny_dirs["target"]), default_drafters=["tiny", "ngram"], **common))
        address = f"127.0.0.1:{router.port}"
        for prompt in PROMPTS3:
            ids, _, final = await generate(address, prompt=prompt.encode(), max_new_tokens=N)
            assert ids == no_eos(reference(prompt, N))
            assert list(final.stats.drafters) == ["tiny"]  # routing off: the router's first default drafter
            # fixed depth 2, one drafter, a chain: 2 draft tokens a round, fewer only in the last rounds (length)
            assert 2 * (final.stats.rounds - 2) <= final.stats.drafted_tokens <= 2 * final.stats.rounds
    finally:
        if router is not None:
            await router.stop()
        await scheduler.stop()


@pytest.fixture(scope="module")
def other_drafter_dir(tmp_path_factory, tiny_dirs):
    """Another tiny random LM on the target's tokenizer. Untied: a tied random model mostly repeats its input
    token, as the tied random target does, so it would agree with the target; this one does not."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["target"]))
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    path = tmp_path_factory.mktemp("tiny-other")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


async def test_routing_moves_to_the_drafter_the_target_agrees_with(services, reference, redis_server, tiny_dirs,  # noqa: F811
                                                                   other_drafter_dir):
    """One drafter per round (k = 1). The router's first default is a random LM the target does not agree with,
    the second prompt lookup, which a looping target agrees with. A prompt that repeats itself is predicted
    by prompt lookup, so the prior gives it the first round; on a prompt that does not, routing starts with
    the random LM, must try prompt lookup and then keep it."""
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0}
    started = []
    try:
        other = await serve_drafter(DrafterSettings(name="other", kind="lm", model=str(other_drafter_dir), threads=1, **common))
        started.append(other)
        fusion = await serve_fusion(FusionSettings(
            drafters=f"other=127.0.0.1:{other.port},ngram=127.0.0.1:{services['drafter-ngram'].port}", **common))
        started.append(fusion)
        scheduler = await serve_scheduler(SchedulerSettings(
            verifier=f"127.0.0.1:{services['verifier'].port}", fusion=f"127.0.0.1:{fusion.port}",
            redis_url=redis_server, startup_timeout_s=30, switches="adaptive_depth=off", routing_k=1, routing_max_k=1, **common))
        started.append(scheduler)
        router = await serve_router(RouterSettings(
            scheduler=f"127.0.0.1:{scheduler.port}", fusion=f"127.0.0.1:{fusion.port}",
            model=str(tiny_dirs["target"]), default_drafters=["other", "ngram"], **common))
        started.append(router)
        metrics = scheduler.servicer.metrics
        routed, first = metrics.routed, metrics.first_choice
        for prompt, first_drafters in (("a b c a b c a b", ["ngram", "other"]), (PROMPTS[1], ["other", "ngram"])):
            # the tiny random target falls into loops prompt lookup predicts
            before = {n: (routed.labels(n)._value.get(), first.labels(n)._value.get()) for n in ("other", "ngram")}
            ids, _, final = await generate(f"127.0.0.1:{router.port}", prompt=prompt.encode(), max_new_tokens=64)
            assert ids == no_eos(reference(prompt, 64))
            chosen = {n: routed.labels(n)._value.get() - before[n][0] for n in ("other", "ngram")}
            firsts = {n: first.labels(n)._value.get() - before[n][1] for n in ("other", "ngram")}
            assert firsts == {first_drafters[0]: 1, first_drafters[1]: 0}
            assert list(final.stats.drafters)[0] == first_drafters[0]  # the prior's choice drafted the first round
            assert chosen["ngram"] >= 0.8 * final.stats.rounds > chosen["other"], (chosen, final.stats)
            assert final.stats.accepted_tokens > 0
    finally:
        for service in reversed(started):
            await service.stop()


@pytest.mark.parametrize("fusion,drafters", [("single", ["tiny"]), ("confidence", ["tiny", "ngram"]), ("merge", ["tiny", "ngram"])])
async def test_drafting_ahead_is_used_when_the_round_goes_as_assumed(services, reference, redis_server, fusion,  # noqa: F811
                                                                      drafters):
    """One request in flight, a drafter the looping target agrees with (the tiny tied random LM repeats its
    input token, as the target does): the next round is drafted while the verifier works, and used when the
    verifier accepts the whole chain and the guessed bonus token."""
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0}
    scheduler = await serve_scheduler(SchedulerSettings(  # a fresh cost model: nothing says drafting would not hide
        verifier=f"127.0.0.1:{services['verifier'].port}", fusion=f"127.0.0.1:{services['fusion'].port}",
        redis_url=redis_server, startup_timeout_s=30, switches=f"adaptive_depth=off,fusion={fusion}", **common))
    try:
        ahead = scheduler.servicer.metrics.ahead
        tokenizer = services["router"].servicer.tokenizer
        for pipelining in (True, False):
            before = {o: ahead.labels(o)._value.get() for o in ("used", "discarded")}
            prompt = "a b c a b c a b"
            ids = tokenizer(prompt)["input_ids"]
            got = []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
                async for reply in scheduler_pb2_grpc.SchedulerStub(channel).Submit(scheduler_pb2.SubmitRequest(
                        request_id=f"ahead-{fusion}-{pipelining}", prompt_token_ids=ids, max_new_tokens=48,
                        speculation=common_pb2.SpeculationParams(drafters=drafters, pipelining=pipelining)), timeout=60):
                    if reply.WhichOneof("kind") == "tokens":
                        got += reply.tokens.token_ids
            assert got == reference(prompt, 48)
            moved = {o: ahead.labels(o)._value.get() - before[o] for o in ("used", "discarded")}
            if pipelining:
                assert moved["used"] >= 1, moved
            else:
                assert moved == {"used": 0, "discarded": 0}
    finally:
        await scheduler.stop()


async def test_fusion_answers_a_scored_open_with_every_drafters_prompt_fit(services, tiny_dirs):  # noqa: F811
    """The prior's numbers travel drafter → fusion → scheduler unchanged: each is what the drafter computes locally,
    and a drafter that scored (so prefilled) the prompt drafts exactly what it drafts without scoring."""
    from cosine.engine.drafters import LMDrafter, NgramDrafter
    from cosine.engine.models import load_causal_lm
    from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc

    prompt = [1, 5, 9, 1, 5, 9, 2, 7, 1, 5, 300, 42]
    local = {"ngram": NgramDrafter(), "tiny": LMDrafter("tiny", load_causal_lm(tiny_dirs["drafter"]))}
    expected = {}
    for name, d in local.items():
        d.open("r", prompt)
        expected[name] = d.score_prompt("r")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services['fusion'].port}") as channel:
        stub = fusion_pb2_grpc.FusionStub(channel)
        replies = {}
        for scored in (True, False):
            call = stub.Speculate(timeout=60)
            await call.write(fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
                request_id=f"fit-{scored}", prompt_token_ids=prompt, drafters=["tiny", "ngram"],
                fusion=common_pb2.FUSION_MODE_MERGE, score_prompt=scored)))
            if scored:
                fits = {f.drafter: f for f in (await call.read()).prompt_fits}
                assert sorted(fits) == ["ngram", "tiny"]
                for name, want in expected.items():
                    got = fits[name]
                    assert (got.positions, got.hits) == (want.positions, want.hits) == (len(prompt) - 1, got.hits)
                    assert got.confidence_sum == pytest.approx(want.confidence_sum, rel=1e-3)
                    assert got.has_logprob == (want.logprob_sum is not None)
                    if got.has_logprob:
                        assert got.logprob_sum == pytest.approx(want.logprob_sum, rel=1e-3)
                assert fits["ngram"].hits >= 2  # "1 5" → 9 after the first repeat, "9" → 1 ...
            await call.write(fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(depth=4)))
            reply = await call.read()
            replies[scored] = {p.drafter: list(p.token_ids) for p in reply.proposals}
            call.cancel()
        assert replies[True] == replies[False]


async def test_what_routing_and_adaptive_depth_learnt_is_in_redis(services, redis_server):
    """Each commit carries the request's router scores (prior included) and acceptance estimate:
    a replica taking over restores them (`ExpertiseRouter.from_dict`)."""
    import redis.asyncio as aioredis

    from cosine.common.state import RequestStore
    from cosine.scheduler.routing import ExpertiseRouter

    _, _, final = await generate(services.router, request_id="learnt", prompt=b"a b c a b c a b", max_new_tokens=24)
    client = aioredis.from_url(redis_server)
    try:
        state = await RequestStore(client).load("learnt")
    finally:
        await client.aclose()
    assert state.status == "finished" and state.policy is not None
    router = ExpertiseRouter.from_dict(state.policy["routing"])
    assert sorted(router.drafters) == ["ngram", "tiny"]
    assert all(ev.prior is not None for ev in router.evidence.values())  # both scored the prompt
    assert 0 < router.rounds <= final.stats.rounds
    assert sum(ev.tries for ev in router.evidence.values()) >= router.rounds
    assert state.policy["speculation"]["trials"] > 0


async def test_no_prompt_scoring_while_the_gate_judges_speculation_unprofitable(services, reference, redis_server):  # noqa: F811
    """Routing's prior makes every candidate drafter prefill the prompt before the first token. While the
    adaptive gate judges that speculation does not pay at this load, a new request skips it: no drafter opens
    it (the request decodes plainly) and its output is the target's own; where the gate judges it pays, the
    prompt is scored as before."""
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0}
    started = []
    try:
        scheduler = await serve_scheduler(SchedulerSettings(
            verifier=f"127.0.0.1:{services['verifier'].port}", fusion=f"127.0.0.1:{services['fusion'].port}",
            redis_url=redis_server, startup_timeout_s=30, gate_window_s=30.0, **common))
        started.append(scheduler)
        router = await serve_router(RouterSettings(
            scheduler=f"127.0.0.1:{scheduler.port}", fusion=f"127.0.0.1:{services['fusion'].port}",
            model=str(services["router"].servicer.tokenizer.name_or_path), default_drafters=["tiny", "ngram"], **common))
        started.append(router)
        first = scheduler.servicer.metrics.first_choice
        opened = {n: services[f"drafter-{n}"].servicer.opened for n in ("tiny", "ngram")}

        def counts():
            return sum(first.labels(n)._value.get() for n in ("tiny", "ngram")), {n: c._value.get() for n, c in opened.items()}

        gate = scheduler.servicer.gate
        for pays, prompt in ((False, PROMPTS[0]), (True, PROMPTS[1])):
            gate.rates = {1: {True: 2.0 if pays else 1.0, False: 1.0 if pays else 2.0}}  # as if measured at one request
            gate._started = None  # the next round opens a window in the judged mode
            chose, opens = counts()
            ids, _, final = await generate(f"127.0.0.1:{router.port}", prompt=prompt.encode(), max_new_tokens=N)
            assert ids == no_eos(reference(prompt, N))
            chose_after, opens_after = counts()
            if pays:
                assert chose_after > chose and all(opens_after[n] == opens[n] + 1 for n in opens), (opens, opens_after)
            else:
                assert chose_after == chose and opens_after == opens and final.stats.drafted_tokens == 0
    finally:
        for service in reversed(started):
            await service.stop()
