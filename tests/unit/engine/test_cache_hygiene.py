"""Cache hygiene: after any sequence of prefill / verify / cut back / release, a slot holds what a
fresh prefill of its committed tokens would (within fp32 rounding), and no other slot changed at all."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosine.engine.llama import NativeLlama, Seq
from cosine.engine.native_target import NativeTarget
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree

pytestmark = pytest.mark.unit

N_SLOTS, MAX_CTX = 3, 64


@pytest.fixture(scope="module")
def model(tiny_models):
    return NativeLlama.from_pretrained(tiny_models["tinyvocab"])  # 8 tokens: drafts often accepted


def fresh_kv(model: NativeLlama, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cache = model.new_cache(1, MAX_CTX)
    slot = cache.allocate()
    n = len(tokens) - 1
    if n:
        model.forward([Seq(slot, tokens[:-1], list(range(n)), logits="none")], cache)
    return cache.k[:, slot, :, :n], cache.v[:, slot, :, :n]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (the never-written part of the cache may hold NaNs)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


tokens_st = st.lists(st.integers(0, 7), min_size=1, max_size=12)
tree_st = st.integers(0, 6).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 7), min_size=n, max_size=n),
    st.tuples(*[st.integers(-1, i - 1) for i in range(n)]),
))
op_st = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 3), tokens_st),
    st.tuples(st.just("verify"), st.integers(0, 3), tree_st, st.booleans()),
    st.tuples(st.just("verify_all"), tree_st),
    st.tuples(st.just("cut"), st.integers(0, 3), st.integers(1, 40)),
    st.tuples(st.just("release"), st.integers(0, 3)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=10))
def test_cache_hygiene(model, ops):
    target = NativeTarget(model, max_context=MAX_CTX, n_slots=N_SLOTS)
    cache = target.cache
    for op in ops:
        kind, args = op[0], op[1:]
        rid = f"r{args[0]}" if kind in ("open", "verify", "cut", "release") else None
        touched: set[int] = set()
        if kind == "open":
            if rid not in target and cache.free_slots == 0:
                continue
            if rid in target:
                touched.add(target.slot_of(rid))
        elif kind in ("verify", "cut", "release") and rid not in target:
            continue
        before_k, before_v = cache.k.clone(), cache.v.clone()
        if kind == "open":
            target.open(rid, list(args[1]), len(args[1]))
            touched.add(target.slot_of(rid))
        elif kind == "verify":
            toks, parents = args[1]
            tree = DraftTree(list(toks), list(parents))
            if len(target.committed(rid)) + len(tree) > MAX_CTX:
                continue
            touched.add(target.slot_of(rid))
            target.verify(rid, tree, Sampling(temperature=0.9, seed=3) if args[2] else Sampling())
        elif kind == "verify_all":
            toks, parents = args[0]
            rids = [r for r in (f"r{i}" for i in range(4)) if r in target
                    and len(target.committed(r)) + len(toks) <= MAX_CTX]
            touched |= {target.slot_of(r) for r in rids}
            target.verify_batch([(r, DraftTree(list(toks), list(parents)), Sampling()) for r in rids])
        elif kind == "cut":
            n = min(args[1], len(target.committed(rid)))
            t0 = time.perf_counter()
            target.truncate(rid, n)
            assert time.perf_counter() - t0 < 0.01
        elif kind == "release":
            target.release(rid)
        # no other slot changed at all (release / cut change no tensor)
        for slot in range(N_SLOTS):
            if slot not in touched:
                assert same_bits(cache.k[:, slot], before_k[:, slot]), (kind, slot)
                assert same_bits(cache.v[:, slot], before_v[:, slot]), (kind, slot)
        # every live slot holds exactly the KV of its committed tokens but the last
        for r in (f"r{i}" for i in range(4)):
            if r not in target:
                continue
            committed = target.committed(r)
            slot = target.slot_of(r)
            assert cache.lengths[slot] == len(committed) - 1
            k_ref, v_ref = fresh_kv(model, committed)
            n = len(committed) - 1
            torch.testing.assert_close(cache.k[:, slot, :, :n], k_ref, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(cache.v[:, slot, :, :n], v_ref, atol=1e-5, rtol=1e-4)
    assert len({target.slot_of(r) for r in (f"r{i}" for i in range(4)) if r in target}) == len(target)
