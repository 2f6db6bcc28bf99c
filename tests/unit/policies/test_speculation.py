"""Adaptive speculation control on constructed loads and costs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.scheduler.speculation import (
    RequestSpeculation,
    SpeculationController,
    SpeculationCosts,
    best_depth,
    expected_tokens,
)
from cosine.common.batching import shorten_longest_first


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 0) == 1.0


def test_acceptance_estimate_is_the_per_token_rate():
    r = RequestSpeculation(decay=1.0, prior_weight=0.0)
    for _ in range(50):
        r.observe(drafted=4, accepted=1)  # 1 success, then 1 failure: α = 1/2
    assert r.alpha == pytest.approx(0.5)
    r = RequestSpeculation(decay=1.0, prior_weight=0.0)
    r.observe(4, 4)  # all accepted: 4 successes, no failure
    r.observe(4, 0)
    assert r.alpha == pytest.approx(4 / 5)
    assert r.accepted_ema == pytest.approx(2.0)
    with pytest.raises(ValueError):
        r.observe(2, 3)


def test_falls_back_to_zero_when_drafting_costs_more_than_it_saves():
    # drafting a token costs as much as a verification: even α = 0.6 does not pay
    costly = SpeculationCosts(draft_step_s=0.02, verify_s=0.02)
    assert best_depth(0.6, costly, 8) == 0
    cheap = SpeculationCosts(draft_step_s=0.001, verify_s=0.02, verify_per_token_s=0.0005)
    d = best_depth(0.8, cheap, 8)
    assert d >= 3
    assert best_depth(0.0, cheap, 8) == 0  # nothing is ever accepted
    # pipelined: drafting hides behind verification, so speculation pays up to d·c ≈ v
    assert best_depth(0.6, SpeculationCosts(0.02, 0.02, pipelined=True), 8) == 1
    r = RequestSpeculation(max_depth=8)
    for _ in range(10):
        r.observe(4, 0)
    assert r.depth(cheap) == 0 and r.budget(0) == 0


def test_depth_follows_recent_acceptance():
    costs = SpeculationCosts(draft_step_s=0.002, verify_s=0.02, verify_per_token_s=0.0005)
    good, bad = RequestSpeculation(max_depth=12), RequestSpeculation(max_depth=12)
    for _ in range(10):
        good.observe(6, 6)
        bad.observe(6, 1)
    assert good.depth(costs) > bad.depth(costs) > 0
    assert good.depth(costs, cap=3) == 3
    assert good.budget(4) == 4 + round(4 * (1 - good.alpha))
    assert bad.budget(4) > good.budget(4)
    assert bad.budget(4, max_budget=5) == 5


def test_costs_from_time_models():
    c = SpeculationCosts.from_models(lambda d: 0.001 + 0.003 * d, lambda d: 0.02 + 0.001 * d)
    assert c.draft_step_s == pytest.approx(0.003)
    assert c.verify_s == pytest.approx(0.02) and c.verify_per_token_s == pytest.approx(0.001)


def test_controller_shrinks_when_the_queue_grows_and_grows_when_the_verifier_idles():
    c = SpeculationController(max_depth=6, max_drafters=3, depth_cap=3, drafters=2, queue_high=2)
    assert c.update_load(verifier_idle=0.0, verifier_queue=5) == "shrink"
    assert (c.depth_cap, c.drafters) == (3, 1)  # drafters go first
    for _ in range(3):
        c.update_load(0.0, 5)
    assert c.depth_cap == 0  # at high load: plain decoding
    assert c.update_load(0.0, 5) == "hold"
    assert c.update_load(0.1, 1) == "hold"  # between the thresholds
    for _ in range(6):
        assert c.update_load(verifier_idle=0.6, verifier_queue=0) == "grow"
    assert (c.depth_cap, c.drafters) == (6, 1)  # depth first
    c.update_load(0.6, 0)
    c.update_load(0.6, 0)
    assert c.drafters == 3 and c.update_load(0.6, 0) == "hold"
    fixed = SpeculationController(adaptive=False, depth_cap=2)
    assert fixed.update_load(0.9, 0) == "hold" and fixed.depth_cap == 2


def test_plan_applies_global_cap_and_token_cap():
    costs = SpeculationCosts(draft_step_s=0.001, verify_s=0.02)
    reqs = {f"r{i}": RequestSpeculation(max_depth=8) for i in range(3)}
    for r in reqs.values():
        for _ in range(5):
            r.observe(8, 8)
    c = SpeculationController(max_depth=8, depth_cap=6)
    assert c.plan(reqs, costs) == {"r0": 6, "r1": 6, "r2": 6}
    c.update_load(0.0, 10)
    c.update_load(0.0, 10)
    assert set(c.plan(reqs, costs).values()) == {4}
    planned = c.plan(reqs, costs, token_cap=12)  # 3 roots + 9 drafts
    assert sum(planned.values()) == 9
    fixed = SpeculationController(adaptive=False, depth_cap=5)
    assert fixed.plan({"x": RequestSpeculation(max_depth=3)}, None) == {"x": 3}


def test_shorten_takes_from_the_longest_first():
    assert shorten_longest_first({"a": 2, "b": 8, "c": 5}, 11) == {"a": 2, "b": 5, "c": 4}
    assert shorten_longest_first({"a": 2, "b": 3}, 10) == {"a": 2, "b": 3}
    assert shorten_longest_first({"a": 4, "b": 4}, 7) == {"a": 4, "b": 3}  # tie: the later one
    assert shorten_longest_first({"a": 3, "b": 3}, 0, floor=1) == {"a": 1, "b": 1}


@settings(max_examples=100, deadline=None)
@given(depths=st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 20), max_size=8), cap=st.integers(0, 100))
def test_shorten_meets_the_cap_and_never_lengthens(depths, cap):
    out = shorten_longest_first(depths, cap)
    assert sum(out.values()) <= cap or all(v == 0 for v in out.values())
    assert all(0 <= out[k] <= depths[k] for k in depths)
    if sum(depths.values()) > cap:
        assert sum(out.values()) == cap  # cut exactly to the cap, no more
        # longest-first: nothing cut while a longer one stayed longer than it
        cut = [k for k in depths if out[k] < depths[k]]
        assert all(out[k] >= max(out.values()) - 1 for k in cut)
