"""The native engine on the real target (SmolLM2-135M): greedy output identical to `transformers` generate."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.models import load_causal_lm
from cosine.engine.native_target import NativeTarget

from .helpers import hf_greedy, speculative_greedy

pytestmark = pytest.mark.e2e


def test_real_target_greedy_batch4_trees(target_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(target_dir))
        texts = ["The capital of France is", "def fibonacci(n):\n    ",
                 "Once upon a time, in a small village by the sea, there lived an old fisherman who",
                 "1, 2, 3, 5, 8, 13,"]
        prompts = {f"r{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
        hf = load_causal_lm(target_dir)
        n_new = 16
        refs = {rid: hf_greedy(hf, p, n_new + 12) for rid, p in prompts.items()}
        target = NativeTarget.from_pretrained(target_dir, n_slots=4, max_context=256)
        for shape in ("tree", "chain"):
            got = speculative_greedy(target, prompts, refs, n_new, random.Random(shape), chain=shape == "chain")
            for rid in prompts:
                assert got[rid] == refs[rid][:n_new], (shape, rid)
            for rid in prompts:
                target.release(rid)
    finally:
        torch.set_num_threads(before)
