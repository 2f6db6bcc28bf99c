"""Drafters score the prompt for expertise routing's prior: what they would have predicted at each prompt position."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.engine import drafters as drafters_mod
from cosine.engine.drafters import LMDrafter, NativeLMDrafter, NgramDrafter
from cosine.engine.vocab import DraftVocab


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(1, 4))
def test_ngram_prompt_fit_is_what_draft_would_have_proposed_at_every_position(prompt, max_ngram):
    d = NgramDrafter(max_ngram=max_ngram)
    d.open("r", prompt)
    fit = d.score_prompt("r")
    hits = positions = 0
    confidence = 0.0
    for i in range(1, len(prompt)):
        ref = NgramDrafter(max_ngram=max_ngram)
        ref.open("x", prompt[:i])
        tokens, probs = ref.draft("x", [], 1)
        positions += 1
        if tokens:
            hits += tokens[0] == prompt[i]
            confidence += probs[0]
    assert (fit.positions, fit.hits) == (positions, hits)
    assert fit.confidence_sum == pytest.approx(confidence)
    assert fit.logprob_sum is None


def test_ngram_scores_only_the_last_positions_of_a_long_prompt(monkeypatch):
    monkeypatch.setattr(drafters_mod, "SCORED_POSITIONS", 5)
    d = NgramDrafter()
    d.open("r", [1, 2, 3] * 10)
    fit = d.score_prompt("r")
    assert fit.positions == 5 and fit.hits == 5  # the repeating tail is predicted every time


TARGET_VOCAB = 120  # with a reduced vocabulary: the model's 96 outputs are target ids 95..0, ids 96..119 are outside


@pytest.fixture(params=["native", "transformers"])
def make_lm(request, tiny_models, hf_models):
    from cosine.engine.llama import NativeLlama

    if request.param == "native":
        model = NativeLlama.from_pretrained(tiny_models["llama"])
        return lambda vocab=None: NativeLMDrafter("lm", model, n_slots=2, max_len=128, vocab=vocab,
                                                  target_vocab_size=TARGET_VOCAB if vocab else 0)
    return lambda vocab=None: LMDrafter("lm", hf_models["llama"], vocab=vocab, target_vocab_size=TARGET_VOCAB if vocab else 0)


def reference_fit(model, prompt, vocab=None):
    ids = vocab.to_draft(prompt) if vocab else prompt
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    hits, conf, lp = 0, 0.0, 0.0
    for j, t in enumerate(prompt[1:]):
        known = vocab is None or t in vocab
        index = vocab.to_draft([t])[0] if vocab else t
        hits += known and int(logp[j].argmax()) == index
        conf += float(logp[j].max().exp())
        lp += float(logp[j, index]) if known else -math.log(TARGET_VOCAB if vocab else 96)
    return len(prompt) - 1, hits, conf, lp


@pytest.mark.parametrize("reduced", [False, True])
def test_lm_prompt_fit_matches_a_full_forward_and_drafting_is_unchanged(make_lm, hf_models, reduced):
    rng = random.Random(3)
    vocab = DraftVocab(list(range(95, -1, -1))) if reduced else None
    prompt = [rng.randrange(TARGET_VOCAB if reduced else 96) for _ in range(30)]
    drafter, plain = make_lm(vocab), make_lm(vocab)
    drafter.open("r", prompt)
    fit = drafter.score_prompt("r")
    positions, hits, conf, lp = reference_fit(hf_models["llama"], prompt, vocab)
    assert fit.positions == positions
    assert fit.hits == hits
    assert fit.confidence_sum == pytest.approx(conf, rel=1e-3)
    assert fit.logprob_sum == pytest.approx(lp, rel=1e-3)
    # the prefill is kept for drafting, which is exactly what it is without scoring
    plain.open("r", prompt)
    for new in ([], [5, 7], [9]):
        got, want = drafter.draft("r", new, 4), plain.draft("r", new, 4)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-4)


def test_lm_scores_only_the_last_positions_of_a_long_prompt(make_lm, hf_models, monkeypatch):
    monkeypatch.setattr(drafters_mod, "SCORED_POSITIONS", 6)
    prompt = list(range(3, 40))
    drafter = make_lm()
    drafter.open("r", prompt)
    fit = drafter.score_prompt("r")
    assert fit.positions == 6
    # the scored rows see the whole prompt before them, not only the last 7 tokens
    with torch.no_grad():
        logp = torch.log_softmax(hf_models["llama"](torch.tensor([prompt])).logits[0, -7:-1].float(), -1)
    assert fit.logprob_sum == pytest.approx(sum(float(logp[j, t]) for j, t in enumerate(prompt[-6:])), rel=1e-3)


def test_a_one_token_prompt_scores_nothing(make_lm):
    d = make_lm()
    d.open("r", [4])
    assert d.score_prompt("r").positions == 0
    assert len(d.draft("r", [], 2)[0]) == 2
