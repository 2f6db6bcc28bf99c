"""Every combination of the mechanisms' switches, through real services: greedy output never changes.

Fusion (confidence / merge / single) x adaptive depth (on / off) x expertise routing (on / off),
per request, on the in-process cluster of tiny random models; plus a scheduler whose switches
come from its settings (COSINE_SCHEDULER_SWITCHES).
"""

from __future__ import annotations

import itertools

import pytest

from cosine.common.v1 import common_pb2
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.__main__ import SchedulerSettings
from cosine.scheduler.__main__ import serve as serve_scheduler
from tests.integration.test_metrics import scrape_all, value
from tests.integration.test_services import PROMPTS, generate, no_eos, reference  # noqa: F401 - reference is a fixture

FUSION = {"confidence": common_pb2.FUSION_MODE_CONFIDENCE, "merge": common_pb2.FUSION_MODE_MERGE,
          "single": common_pb2.FUSION_MODE_SINGLE}
PROMPTS3 = [PROMPTS[0], PROMPTS[1], "a b c a b c a b"]
N = 20


@pytest.fixture(scope="module")
async def plain(services):
    """Each prompt decoded by the target alone, through the cluster (speculation disabled)."""
    out = {}
    for prompt in PROMPTS3:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={"disabled": True})
        assert final.stats.drafted_tokens == 0
        out[prompt] = ids
    return out


@pytest.mark.parametrize("fusion,adaptive,routing", list(itertools.product(FUSION, (True, False), (True, False))))
async def test_greedy_output_is_the_targets_under_every_switch(services, reference, plain, fusion, adaptive, routing):  # noqa: F811
    before = (await scrape_all(services))["fusion"]
    drafted = 0
    for prompt in PROMPTS3:
        ids, _, final = await generate(services.router, prompt=prompt.encode(), max_new_tokens=N, speculation={
            "fusion": FUSION[fusion], "adaptive_depth": adaptive, "routing": routing})
        assert ids == plain[prompt] == no_eos(reference(prompt, N)), (prompt, fusion, adaptive, routing)
        drafted += final.stats.drafted_tokens
        used = list(final.stats.drafters)
        if not routing or fusion == "single":
            assert len(used) <= 1 or (routing and fusion == "single"), used  # single with routing may explore
        if not routing:
            assert used in ([], ["ngram"]), used  # the fixed drafter: the router's first default
        if routing and fusion != "single" and final.stats.drafted_tokens:
            assert set(used) == {"ngram", "tiny"}, used  # routing exploits the top 2 of the two candidates
    assert drafted > 0
    after = (await scrape_all(services))["fusion"]
    moved = (value(after, "cosine_fusion_rounds_total", mode=fusion) or 0) - (value(before, "cosine_fusion_rounds_total", mode=fusion) or 0)
    assert moved > 0, f"fusion ran no {fusion} round"


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
