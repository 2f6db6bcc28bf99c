"""Suffix decoding through the services: lossless, its global memory learns from released requests and is exported."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cosine.common.v1 import common_pb2
from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.fusion.__main__ import FusionSettings
from cosine.fusion.__main__ import serve as serve_fusion
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.__main__ import SchedulerSettings
from cosine.scheduler.__main__ import serve as serve_scheduler
from cosine.verifier.__main__ import VerifierSettings
from cosine.verifier.__main__ import serve as serve_verifier
from tests.integration.test_services import PROMPTS, generate, no_eos, reference, wait_until  # noqa: F401  (fixture)

MEMORY_TOKENS = 48


@pytest.fixture(scope="module")
async def suffix_services(tiny_dirs, redis_server):
    """The five services with a suffix drafter (a small memory bound, so eviction happens) and the tiny LM drafter."""
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0}
    s = {}
    s["verifier"] = await serve_verifier(VerifierSettings(model=str(tiny_dirs["target"]), threads=1, **common))
    s["drafter-suffix"] = await serve_drafter(DrafterSettings(name="suffix", kind="suffix", memory_tokens=MEMORY_TOKENS, **common))
    s["drafter-tiny"] = await serve_drafter(DrafterSettings(name="tiny", kind="lm", model=str(tiny_dirs["drafter"]), threads=1, **common))
    s["fusion"] = await serve_fusion(FusionSettings(
        drafters=f"suffix=127.0.0.1:{s['drafter-suffix'].port},tiny=127.0.0.1:{s['drafter-tiny'].port}", **common))
    s["scheduler"] = await serve_scheduler(SchedulerSettings(
        verifier=f"127.0.0.1:{s['verifier'].port}", fusion=f"127.0.0.1:{s['fusion'].port}", redis_url=redis_server,
        startup_timeout_s=30, gate_window_s=0, **common))  # no gate: these tests measure what drafting accepts
    s["router"] = await serve_router(RouterSettings(
        scheduler=f"127.0.0.1:{s['scheduler'].port}", fusion=f"127.0.0.1:{s['fusion'].port}", model=str(tiny_dirs["target"]),
        default_drafters=["suffix", "tiny"], max_new_tokens_limit=256, **common))
    yield s
    for name in ("router", "scheduler", "fusion", "drafter-tiny", "drafter-suffix", "verifier"):
        await s[name].stop()


def _address(services) -> str:
    return f"127.0.0.1:{services['router'].port}"


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("drafter") == "suffix"}


FUSION = {"confidence": common_pb2.FUSION_MODE_CONFIDENCE, "merge": common_pb2.FUSION_MODE_MERGE,
          "single": common_pb2.FUSION_MODE_SINGLE}


@pytest.mark.parametrize("fusion,drafters", [("single", ["suffix"]), ("confidence", ["suffix"]),
                                             ("confidence", ["suffix", "tiny"]), ("merge", ["suffix", "tiny"])])
async def test_greedy_output_equals_the_target_alone(suffix_services, reference, fusion, drafters):
    for prompt in PROMPTS:
        ids, _, final = await generate(_address(suffix_services), prompt=prompt.encode(), max_new_tokens=32, speculation={
            "drafters": drafters, "fusion": FUSION[fusion], "routing": False})
        assert ids == no_eos(reference(prompt, 32))
        assert final.stats.rounds > 0


async def test_the_default_drafters_are_lossless_too(suffix_services, reference):
    ids, _, _ = await generate(_address(suffix_services), prompt=PROMPTS[2].encode(), max_new_tokens=24)
    assert ids == no_eos(reference(PROMPTS[2], 24))


async def test_a_repeated_request_drafts_from_memory_and_memory_stays_bounded(suffix_services, reference):
    drafter = suffix_services["drafter-suffix"].servicer.drafter
    address = _address(suffix_services)
    speculation = {"drafters": ["suffix"], "fusion": FUSION["single"], "routing": False, "adaptive_depth": False, "max_depth": 6}
    prompt = "Once upon a time, in a land far away"
    # fill the memory with other outputs first, past its bound: eviction of the oldest
    for i in range(4):
        await generate(address, prompt=f"{PROMPTS[i % 4]} {i}".encode(), max_new_tokens=20, speculation=speculation)
    assert await wait_until(lambda: drafter.memory.evicted_tokens > 0)
    def remembered() -> int:  # outputs the memory took in so far
        return drafter.memory.sequences + drafter.memory.evicted_sequences

    # every earlier output in: no stream open here, and the releases queued on the model thread done (it runs
    # calls in order); else a release still queued lands during the next request and the count jumps by two
    servicer = suffix_services["drafter-suffix"].servicer
    assert await wait_until(lambda: not servicer.open_ids)
    await servicer.worker.run(lambda: None)
    before = await asyncio.to_thread(remembered)
    first_ids, _, first = await generate(address, prompt=prompt.encode(), max_new_tokens=40, speculation=speculation)
    assert await wait_until(lambda: remembered() == before + 1)  # released: its output is in the memory
    # the same request again: the memory holds what the target wrote the first time
    again_ids, _, again = await generate(address, prompt=prompt.encode(), max_new_tokens=40, speculation=speculation)
    assert again_ids == first_ids == no_eos(reference(prompt, 40))
    assert again.stats.accepted_tokens > first.stats.accepted_tokens
    assert again.stats.rounds < first.stats.rounds
    assert drafter.memory.tokens <= MEMORY_TOKENS
    samples = await asyncio.to_thread(_scrape, suffix_services["drafter-suffix"].metrics.port)
    assert samples["cosine_drafter_memory_limit_tokens"] == MEMORY_TOKENS
    assert 0 < samples["cosine_drafter_memory_tokens"] <= MEMORY_TOKENS
    assert samples["cosine_drafter_memory_evicted_tokens_total"] > 0
    assert samples["cosine_drafter_memory_sequences"] >= 1


async def test_fusion_answers_a_scored_open_with_the_suffix_drafters_prompt_fit(suffix_services):
    """Expertise routing's prior: the suffix drafter scores the prompt at open like any other drafter, and the
    numbers reach fusion's caller unchanged."""
    import grpc

    from cosine.engine.suffix import SuffixDrafter
    from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc

    served = suffix_services["drafter-suffix"].servicer.drafter
    prompt = [1, 5, 9, 1, 5, 9, 2, 7, 1, 5, 300, 42]
    local = SuffixDrafter(memory=served.memory)  # the same memory: its earlier outputs count for the prior too
    local.open("r", prompt)
    want = local.score_prompt("r")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{suffix_services['fusion'].port}") as channel:
        call = fusion_pb2_grpc.FusionStub(channel).Speculate(timeout=60)
        await call.write(fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
            request_id="fit", prompt_token_ids=prompt, drafters=["suffix", "tiny"],
            fusion=common_pb2.FUSION_MODE_CONFIDENCE, score_prompt=True)))
        fits = {f.drafter: f for f in (await call.read()).prompt_fits}
        got = fits["suffix"]
        assert (got.positions, got.hits) == (want.positions, want.hits) == (len(prompt) - 1, got.hits)
        assert got.hits >= 3  # "1 5" → 9, "5 9" → 1, "1 5" → 9 ... after the first repeat
        assert got.confidence_sum == pytest.approx(want.confidence_sum, rel=1e-5) and not got.has_logprob
        await call.write(fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(depth=4)))
        reply = await call.read()
        assert {p.drafter for p in reply.proposals} == {"suffix", "tiny"}
        call.cancel()
