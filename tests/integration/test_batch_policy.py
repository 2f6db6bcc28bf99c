"""The verifier's objective batch policy through real servers: a small token cap defers and trims, losslessly."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import start_services, stop_services
from tests.integration.test_metrics import scrape_all, value
from tests.integration.test_services import PROMPTS, generate, no_eos, reference  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
async def capped(tiny_dirs, redis_server):
    # 3 positions and 1 round a step: trees cut, longest first, other rounds wait (extra settings reach every
    # service; only the verifier reads these)
    started = await start_services(tiny_dirs, redis_server, batch_policy="objective", max_batch_tokens=3, max_batch=1)
    yield started
    await stop_services(started)


async def test_a_small_token_cap_defers_and_trims_and_output_is_the_targets(capped, reference):  # noqa: F811
    assert capped["verifier"].servicer.batcher.limits.max_tokens == 3
    before = (await scrape_all(capped))["verifier"]
    prompts = [f"{PROMPTS[i % 4]} a b a b {i}" for i in range(8)]
    speculation = {"drafters": ["ngram", "tiny"], "adaptive_depth": False, "max_depth": 4}
    results = await asyncio.gather(*(generate(capped.router, prompt=p.encode(), max_new_tokens=20, speculation=speculation)
                                     for p in prompts))
    for prompt, (ids, _, final) in zip(prompts, results):
        assert ids == no_eos(reference(prompt, 20))
    after = (await scrape_all(capped))["verifier"]

    def moved(metric: str) -> float:
        return (value(after, metric) or 0.0) - (value(before, metric) or 0.0)

    assert moved("cosine_verifier_batch_deferred_sum") > 0  # 8 streams, one round a step
    assert moved("cosine_verifier_trees_trimmed_total") > 0
    assert moved("cosine_verifier_batch_tokens_count") > 0
    steps, tokens = moved("cosine_verifier_batch_tokens_count"), moved("cosine_verifier_batch_tokens_sum")
    assert tokens <= 3 * steps
    # the cap holds on every step: nothing above the 4-token bucket
    assert value(after, "cosine_verifier_batch_tokens_bucket", le="4.0") == value(after, "cosine_verifier_batch_tokens_count")
