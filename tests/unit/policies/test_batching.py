"""Batch choice and time models on constructed pools and synthetic measurements."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.common.batching import (
    BatchLimits,
    DraftTimeModel,
    Measurement,
    ReadyRequest,
    VerifyTimeModel,
    choose_batch,
    draft_round_time,
)

# 10 ms fixed, 0.1 ms per verified token, 1 µs per context token per request
MODEL = VerifyTimeModel([0.010, 1e-4, 1e-6, 0.0])


def req(rid, wait=0.0, ctx=100, draft=4, kv=0, gain=2.0):
    return ReadyRequest(rid, wait, ctx, draft, kv, gain)


def test_verify_model_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    true = np.array([0.012, 2e-4, 3e-6, 5e-8])
    m = VerifyTimeModel()
    for _ in range(200):
        b, L, d = int(rng.integers(1, 17)), int(rng.integers(1, 4096)), int(rng.integers(0, 17))
        t = float(true @ VerifyTimeModel.features(b, L, d))
        m.add(Measurement(b, L, d, t * (1 + rng.normal(0, 1e-3))))
    coef = m.fit()
    assert np.allclose(coef, true, rtol=0.05, atol=1e-9)
    assert m.predict(8, 1000, 4) == pytest.approx(float(true @ VerifyTimeModel.features(8, 1000, 4)), rel=0.01)


def test_draft_model_recovers_known_coefficients_and_slowest_drafter_sets_the_round():
    rng = np.random.default_rng(1)
    true = np.array([0.002, 0.004, 5e-4, 1e-7])
    m = DraftTimeModel()
    for _ in range(100):
        b, L, d = int(rng.integers(1, 9)), int(rng.integers(1, 2048)), int(rng.integers(1, 9))
        m.add(Measurement(b, L, d, float(true @ DraftTimeModel.features(b, L, d))))
    assert np.allclose(m.fit(), true, rtol=1e-6, atol=1e-12)
    fast = DraftTimeModel([0.0, 0.001, 0.0, 0.0])
    t = draft_round_time({"slow": m, "fast": fast}, {"slow": (2, 100, 4), "fast": (2, 100, 4)})
    assert t == pytest.approx(m.predict(2, 100, 4))
    assert t > fast.predict(2, 100, 4)
    assert draft_round_time({}, {}) == 0.0


def test_under_determined_model_keeps_its_starting_coefficients():
    m = VerifyTimeModel([0.01, 0.0, 0.0, 0.0])
    m.fit([Measurement(1, 10, 1, 0.5)] * 10)  # one distinct row: rank 1
    assert m.predict(4, 100, 4) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        VerifyTimeModel([1.0])


def test_every_cap_is_respected():
    pool = [req(f"r{i}", wait=i * 0.01, draft=7, kv=100) for i in range(10)]
    c = choose_batch(pool, MODEL, BatchLimits(max_tokens=24, max_memory=10_000))
    assert c.tokens <= 24 and len(c.request_ids) == 3  # 8 positions each
    c = choose_batch(pool, MODEL, BatchLimits(max_tokens=1000, max_memory=250))
    assert c.memory <= 250 and len(c.request_ids) == 2
    one = MODEL.predict(1, 100, 7)
    c = choose_batch(pool, MODEL, BatchLimits(max_tokens=1000, max_step_s=MODEL.predict(4, 100, 7)))
    assert len(c.request_ids) == 4 and c.step_s <= MODEL.predict(4, 100, 7) + 1e-12
    assert c.step_s >= one


def test_prefers_the_longer_waiting_request_under_a_latency_bound():
    pool = [req("new", wait=0.001, ctx=500), req("old", wait=0.2, ctx=500)]
    bound = MODEL.predict(1, 500, 4) * 1.01  # room for one request only
    c = choose_batch(pool, MODEL, BatchLimits(max_step_s=bound))
    assert c.request_ids == ["old"]
    # same wait: the one with more expected tokens; the tie-break is deterministic
    pool = [req("a", gain=1.5), req("b", gain=3.0)]
    assert choose_batch(pool, MODEL, BatchLimits(max_step_s=MODEL.predict(1, 100, 4))).request_ids == ["b"]
    pool = [req("b"), req("a")]
    assert choose_batch(pool, MODEL, BatchLimits(max_step_s=MODEL.predict(1, 100, 4))).request_ids == ["a"]


def test_overdue_requests_go_first_even_when_worth_less():
    pool = [req("rich", wait=0.0, gain=50.0), req("overdue", wait=1.0, gain=1.0)]
    c = choose_batch(pool, MODEL, BatchLimits(max_tokens=5, deadline_s=0.5, w_wait=0.0))
    assert c.request_ids == ["overdue"]
    assert choose_batch(pool, MODEL, BatchLimits(max_tokens=5, w_wait=0.0)).request_ids == ["rich"]


def test_an_expensive_request_is_left_out_when_not_worth_its_time():
    slow_ctx = VerifyTimeModel([0.01, 0.0, 1e-3, 0.0])  # long contexts are costly
    pool = [req("short", ctx=10, gain=2.0), req("long", ctx=5000, gain=0.5)]
    c = choose_batch(pool, slow_ctx, BatchLimits(w_tokens=1.0, w_wait=0.0, w_time=1.0))
    assert c.request_ids == ["short"]
    c = choose_batch(pool, slow_ctx, BatchLimits(w_tokens=1.0, w_wait=0.0, w_time=0.0))
    assert sorted(c.request_ids) == ["long", "short"]


def test_a_tree_larger_than_the_cap_is_trimmed_not_starved():
    c = choose_batch([req("big", draft=50)], MODEL, BatchLimits(max_tokens=9))
    assert c.request_ids == ["big"] and c.trim == {"big": 8} and c.tokens == 9
    assert choose_batch([], MODEL, BatchLimits()).request_ids == []
    with pytest.raises(ValueError):
        choose_batch([req("x"), req("x")], MODEL, BatchLimits())


@settings(max_examples=100, deadline=None)
@given(
    pool=st.lists(
        st.tuples(st.floats(0, 2), st.integers(1, 4000), st.integers(0, 32), st.integers(0, 1000), st.floats(1, 10)),
        max_size=12,
    ),
    max_tokens=st.integers(1, 128),
    max_memory=st.one_of(st.none(), st.integers(0, 3000)),
    max_step_s=st.one_of(st.none(), st.floats(0, 0.05)),
    deadline_s=st.one_of(st.none(), st.floats(0, 2)),
)
def test_caps_are_never_violated(pool, max_tokens, max_memory, max_step_s, deadline_s):
    requests = [ReadyRequest(f"r{i}", *p) for i, p in enumerate(pool)]
    limits = BatchLimits(max_tokens=max_tokens, max_memory=max_memory, max_step_s=max_step_s, deadline_s=deadline_s)
    c = choose_batch(requests, MODEL, limits)
    by_id = {r.request_id: r for r in requests}
    chosen = [by_id[i] for i in c.request_ids]
    assert len(set(c.request_ids)) == len(c.request_ids)
    tokens = sum(1 + c.trim.get(r.request_id, r.draft_tokens) for r in chosen)
    assert tokens == c.tokens <= max_tokens
    if max_memory is not None:
        assert sum(r.kv_bytes for r in chosen) <= max_memory
    if max_step_s is not None and len(chosen) > 1:
        assert c.step_s <= max_step_s
    # the verifier never idles while some request fits the memory cap
    if any(max_memory is None or r.kv_bytes <= max_memory for r in requests):
        assert chosen


def test_max_requests_caps_the_batch_size():
    pool = [req(f"r{i}", wait=float(i)) for i in range(5)]
    choice = choose_batch(pool, MODEL, BatchLimits(max_requests=2))
    assert choice.request_ids == ["r4", "r3"]
    with pytest.raises(ValueError):
        BatchLimits(max_requests=0)
