"""Drafter evaluation arithmetic and reduced drafting vocabularies, on inputs whose answer is known."""

from collections import Counter

import pytest

from cosine.engine.vocab import DraftVocab, select_vocab
from cosine.zoo.evaluate import match_runs, predicted_speedup, tau


def test_match_runs():
    assert match_runs([True, True, False, True]) == [2, 1, 0, 1]
    assert match_runs([]) == []


def test_tau_of_a_drafter_that_always_agrees_is_depth_plus_one():
    assert tau([True] * 50, 4) == pytest.approx(5.0)
    assert tau([True] * 50, 8) == pytest.approx(50 / 6)  # 5 rounds of 9, the last round of 5


def test_tau_of_a_drafter_that_never_agrees_is_one():
    assert tau([False] * 20, 4) == 1.0


def test_tau_walks_rounds_and_stops_at_the_first_mismatch():
    # rounds: [T T F] accepts 2 then the target's token (p=0..2); [T] at p=3 accepts 0 (last token is the target's)
    assert tau([True, True, False, True], 4) == pytest.approx(4 / 2)
    # depth 1 caps each round at 2 tokens
    assert tau([True, True, True, True], 1) == pytest.approx(2.0)
    assert tau([True, False, True, False], 0) == 1.0


def test_predicted_speedup():
    assert predicted_speedup(2.5, 4, 0.05, 1.2) == pytest.approx(2.5 / 1.4)
    with pytest.raises(ValueError):
        predicted_speedup(1.0, 0, 0.0, 0.0)


def test_select_vocab_keeps_specials_then_the_most_frequent():
    counts = Counter({10: 5, 11: 9, 12: 9, 13: 1})
    vocab = select_vocab(counts, 3, always=[0])
    assert vocab.token_ids == [0, 11, 12]
    assert vocab.coverage(counts) == pytest.approx(18 / 24)
    with pytest.raises(ValueError):
        select_vocab(counts, 1, always=[0, 1])


def test_draft_vocab_maps_both_ways_and_falls_back(tmp_path):
    vocab = DraftVocab([7, 3, 9], fallback=0)
    assert vocab.to_draft([3, 9, 12345]) == [1, 2, 0]
    assert vocab.to_target([2, 1]) == [9, 3]
    vocab.save(tmp_path)
    again = DraftVocab.load(tmp_path)
    assert again.token_ids == [7, 3, 9]
    assert DraftVocab.load(tmp_path / "missing") is None
    with pytest.raises(ValueError):
        DraftVocab([1, 1])
