"""`on_huge_pages`: weights copied into one huge-page-advised mapping, unchanged in value, shape and dtype, and the
engine's packed weights placed there."""

from __future__ import annotations

import mmap

import pytest
import torch

from cosine.engine.hugepages import HUGE_PAGE, on_huge_pages
from cosine.engine.llama import NativeLlama, Seq

pytestmark = pytest.mark.unit

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


@needs_madvise
def test_copies_are_equal_contiguous_aligned_views_of_one_mapping():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).bfloat16(),
               torch.arange(10, dtype=torch.int64), torch.empty(0, 4)]
    moved = on_huge_pages(tensors)
    assert len(moved) == len(tensors)
    for a, b in zip(tensors, moved):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() != a.data_ptr() and b.data_ptr() % 64 == 0 or b.numel() == 0
    assert moved[0].data_ptr() % HUGE_PAGE == 0  # the mapping's first tensor starts on a huge page
    ptrs = sorted(t.data_ptr() for t in moved if t.numel())
    assert ptrs[-1] - ptrs[0] < HUGE_PAGE  # one mapping, packed tightly
    moved[0].add_(1)  # a private copy: the original is untouched
    assert not torch.equal(moved[0], tensors[0])


def test_off_or_nothing_to_move_returns_the_tensors_themselves(monkeypatch):
    t = [torch.ones(4)]
    assert on_huge_pages([]) == []
    monkeypatch.setenv("COSINE_HUGE_PAGES", "0")
    assert on_huge_pages(t)[0] is t[0]


@needs_madvise
def test_the_engines_packed_weights_live_there_and_give_the_same_logits(tiny_models, monkeypatch):
    model = NativeLlama.from_pretrained(tiny_models["llama"])
    if not model.kernel:
        pytest.skip("CoSine's kernel does not run here: the weights are oneDNN's")
    first = model.layers[0].qkv_w.data_ptr()
    assert first % HUGE_PAGE == 0 and model.lm_head.data_ptr() > first
    monkeypatch.setenv("COSINE_HUGE_PAGES", "0")
    plain = NativeLlama.from_pretrained(tiny_models["llama"])
    ids = torch.randint(0, model.spec.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    out = []
    for m in (model, plain):
        cache = m.new_cache(1, 64)
        out.append(m.forward([Seq(cache.allocate(), ids, list(range(20)))], cache)[0])
    assert torch.equal(out[0], out[1])
