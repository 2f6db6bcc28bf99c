"""Speculative context (confidence fusion): a drafter continues from uncommitted tokens without keeping them."""

from __future__ import annotations

import random

import pytest
import torch

from cosine.engine.drafters import LMDrafter, NativeLMDrafter, NgramDrafter


@pytest.fixture(params=["native", "transformers"])
def make_lm(request, tiny_models, hf_models):
    from cosine.engine.llama import NativeLlama

    if request.param == "native":
        model = NativeLlama.from_pretrained(tiny_models["llama"])
        return lambda name: NativeLMDrafter(name, model, n_slots=2, max_len=128)
    return lambda name: LMDrafter(name, hf_models["llama"])


def test_propose_equals_drafting_with_the_context_committed(make_lm, hf_models):
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(9)]
    under_test, reference = make_lm("a"), make_lm("b")
    under_test.open("r", prompt)
    committed: list[int] = []
    for round_ in range(4):
        new = [rng.randrange(96) for _ in range(rng.randint(1, 3))]
        committed += new
        # step-wise, as fusion drives it: the fused chain grows by one (arbitrary) token per step
        context: list[int] = []
        for step in range(3):
            cands = under_test.propose("r", new if step == 0 else [], context, top_k=3)
            reference.open("ref", prompt + committed + context)
            tokens, probs = reference.draft("ref", [], 1)
            reference.release("ref")
            assert len(cands) == 3 and [p for _, p in cands] == sorted((p for _, p in cands), reverse=True)
            assert cands[0][0] == tokens[0] and cands[0][1] == pytest.approx(probs[0], abs=1e-4)
            # the top-k agree with the full model's distribution
            logits = hf_models["llama"](torch.tensor([prompt + committed + context])).logits[0, -1].float()
            expected = torch.softmax(logits, -1).topk(3)
            assert [t for t, _ in cands] == expected.indices.tolist()
            context.append(rng.choice([cands[0][0], rng.randrange(96)]))
        # the context was speculative: the next round's draft continues from the committed tokens only
        chain, _ = under_test.draft("r", [], 4)
        reference.open("ref", prompt + committed)
        assert chain == reference.draft("ref", [], 4)[0]
        reference.release("ref")
    under_test.release("r")


def test_draft_with_context_continues_the_context(make_lm):
    prompt = list(range(10, 20))
    a, b = make_lm("a"), make_lm("b")
    a.open("r", prompt)
    b.open("r", prompt + [5, 6])
    same(a.draft("r", [], 3, context=[5, 6]), b.draft("r", [], 3))
    ref = make_lm("ref")
    ref.open("x", prompt + [7])
    same(a.draft("r", [7], 3), ref.draft("x", [], 3))


def same(got, expected):
    assert got[0] == expected[0] and got[1] == pytest.approx(expected[1], abs=1e-4)


def test_ngram_context_is_looked_up_but_not_kept():
    d = NgramDrafter()
    d.open("r", [1, 2, 3, 9, 1, 2])
    assert d.draft("r", [], 2)[0] == [3, 9]
    assert d.propose("r", [], [3, 9, 1], top_k=4) == [(2, pytest.approx(4 / 5))]  # "2 3 9 1" matched
    assert d.draft("r", [3], 2, context=[7, 7])[0] == [7]  # "... 3 7 7": 7 followed 7
    assert d.draft("r", [], 2)[0] == [9, 1]  # the context is gone: "... 1 2 3" → 9 1
    assert d.propose("r", [], [], top_k=0) == []
