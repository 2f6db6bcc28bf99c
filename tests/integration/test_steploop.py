"""The scheduler's step loop through real servers: concurrent requests meet in one verification batch."""

from __future__ import annotations

import asyncio

from tests.integration.test_metrics import scrape_all, value
from tests.integration.test_services import PROMPTS, generate, no_eos, reference  # noqa: F401 - a fixture


def batches_of(sample: dict, size: int) -> float:
    """Verifier steps of exactly `size` rounds (from the cumulative histogram; buckets 1, 2, 3, 4, 6, ...)."""
    at = value(sample, "cosine_verifier_batch_size_bucket", le=f"{float(size)}") or 0.0
    below = value(sample, "cosine_verifier_batch_size_bucket", le=f"{float(size - 1)}") or 0.0
    return at - below


async def test_four_plain_streams_meet_in_batches_of_four(services, reference):  # noqa: F811
    n = 24
    before = (await scrape_all(services))["verifier"]
    results = await asyncio.gather(*(generate(services.router, prompt=p.encode(), max_new_tokens=n,
                                              speculation={"disabled": True}) for p in PROMPTS))
    after = (await scrape_all(services))["verifier"]
    lengths = []
    for prompt, (ids, _, final) in zip(PROMPTS, results):
        assert ids == no_eos(reference(prompt, n))
        lengths.append(len(ids))
    steps = value(after, "cosine_verifier_batch_size_count") - value(before, "cosine_verifier_batch_size_count")
    fours = batches_of(after, 4) - batches_of(before, 4)
    # while all four are live (the shortest output), every step but the few while they arrive holds all four
    assert fours >= min(lengths) - 3, (fours, steps, lengths)
    rounds = value(after, "cosine_verifier_batch_size_sum") - value(before, "cosine_verifier_batch_size_sum")
    assert rounds == sum(lengths)  # one round per token without speculation
    assert steps <= max(lengths) + 3  # not one step per request and token


async def test_speculating_streams_share_steps_and_stay_lossless(services, reference):  # noqa: F811
    n = 20
    scheduler_before = (await scrape_all(services))["scheduler"]
    speculation = {"drafters": ["ngram", "tiny"], "adaptive_depth": False, "max_depth": 3}
    results = await asyncio.gather(*(generate(services.router, prompt=f"{p} a b a b".encode(), max_new_tokens=n,
                                              speculation=speculation) for p in PROMPTS))
    for prompt, (ids, _, final) in zip(PROMPTS, results):
        assert ids == no_eos(reference(f"{prompt} a b a b", n))
    scheduler_after = (await scrape_all(services))["scheduler"]
    steps = value(scheduler_after, "cosine_scheduler_step_size_count") - (value(scheduler_before, "cosine_scheduler_step_size_count") or 0)
    rounds = value(scheduler_after, "cosine_scheduler_step_size_sum") - (value(scheduler_before, "cosine_scheduler_step_size_sum") or 0)
    # some steps verify several requests (whether a step waits for a draft in flight depends on the measured draft
    # and step times: with drafting as slow as verifying, two groups alternating is the better schedule)
    assert 0 < steps < rounds, (steps, rounds)
