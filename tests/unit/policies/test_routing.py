"""Expertise routing on constructed rounds whose right answer is known."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.scheduler.routing import ExpertiseRouter, PromptFit, agreement, harmonic


def fit(hit_rate: float, confidence: float = 0.5, positions: int = 40, mean_logprob: float | None = -3.0) -> PromptFit:
    return PromptFit(positions, round(hit_rate * positions), confidence * positions,
                     None if mean_logprob is None else mean_logprob * positions)


def test_agreement_scores_only_positions_with_the_targets_context():
    # own chain: scoring stops after the first mismatch (its later tokens followed a wrong context)
    assert agreement([1, 2, 9, 4], [1, 2, 3, 4, 5]) == (2, 3)
    # fused context equal to what was accepted: every position with a known target token counts
    assert agreement([1, 7, 3], [1, 2, 3, 4], context=[1, 2, 3]) == (2, 3)
    # fused context left the accepted path after position 1
    assert agreement([1, 2, 3], [1, 5, 6], context=[1, 2, 3]) == (1, 2)
    assert agreement([], [1, 2]) == (0, 0)
    assert agreement([1, 2, 3], [1]) == (1, 1)  # only the bonus position is known


def test_harmonic_is_low_unless_both_are_high():
    assert harmonic(1.0, 1.0) == 1.0
    assert harmonic(0.9, 0.0) == 0.0
    assert harmonic(0.9, 0.1) < 0.2
    assert harmonic(0.5, 0.5) == pytest.approx(0.5)


def test_prompt_fit_is_the_online_score_on_the_prompt():
    f = PromptFit(positions=10, hits=4, confidence_sum=6.0, logprob_sum=-20.0)
    assert f.hit_rate == 0.4 and f.confidence == 0.6 and f.mean_logprob == -2.0
    assert f.value == pytest.approx(harmonic(0.6, 0.4))
    assert PromptFit(0, 0, 0.0).value == 0.0 and PromptFit(0, 0, 0.0).mean_logprob is None
    assert PromptFit(5, 2, 3.0, None).mean_logprob is None  # n-gram: no distribution


def test_prior_ranks_by_how_well_each_drafter_predicted_the_prompt():
    r = ExpertiseRouter(["code", "prose", "chat"], k=1)
    r.prior("code", fit(0.1))
    r.prior("prose", fit(0.5))
    r.prior("chat", fit(0.3))
    assert r.ranking() == ["prose", "chat", "code"]
    assert r.select() == ["prose"]
    assert r.scores()["prose"] == pytest.approx(0.5)
    r.prior("prose", fit(0.05))  # a new prior replaces the old one
    assert r.select() == ["chat"]
    assert r.scores()["prose"] == pytest.approx(harmonic(0.5, 0.05))


def test_equal_priors_are_ranked_by_prompt_logprob_and_ngram_without_one_last():
    r = ExpertiseRouter(["ngram", "a", "b"], k=2)
    r.prior("ngram", fit(0.3, mean_logprob=None))
    r.prior("a", fit(0.3, mean_logprob=-6.0))
    r.prior("b", fit(0.3, mean_logprob=-4.5))
    assert r.ranking() == ["b", "a", "ngram"]


def test_prior_weight_is_the_positions_scored_up_to_the_cap():
    short = ExpertiseRouter(["a", "b"], k=1, prior_weight=8.0)
    short.prior("a", fit(0.9, confidence=0.9, positions=2))  # two prompt positions: weak evidence
    short.prior("b", fit(0.5, confidence=0.5, positions=40))
    for _ in range(2):  # wrong on its first two rounds
        short.observe("a", [1, 2], [3, 4, 5], [0.9, 0.9])
    assert short.select() == ["b"]
    long = ExpertiseRouter(["a", "b"], k=1, prior_weight=8.0)
    long.prior("a", fit(0.9, confidence=0.9, positions=40))
    long.prior("b", fit(0.5, confidence=0.5, positions=40))
    for _ in range(2):  # two bad rounds do not undo 8 positions of prompt evidence
        long.observe("a", [1, 2], [3, 4, 5], [0.9, 0.9])
    assert long.select() == ["a"]


def test_prior_replaced_after_observations_keeps_only_the_evidence():
    r = ExpertiseRouter(["a"], decay=0.5)
    r.prior("a", fit(0.9, confidence=0.9))
    r.observe("a", [1, 2], [1, 2, 3], [0.8, 0.8])
    r.prior("a", PromptFit(0, 0, 0.0))  # a prior of weight 0 replaces it: only the round is left
    assert r.scores()["a"] == pytest.approx(harmonic(0.8, 1.0))


def test_a_drafter_that_always_agrees_with_the_target_wins():
    r = ExpertiseRouter(["a", "b", "c"], k=1, threshold=0.0)
    # the prior favours "b", but "a" always drafts exactly what the target accepts
    r.prior("a", fit(0.2))
    r.prior("b", fit(0.8))
    r.prior("c", fit(0.4))
    assert r.select() == ["b"]
    target = list(range(100, 140))
    for rnd in range(8):
        accepted = target[rnd * 5 : rnd * 5 + 5]
        r.observe("a", accepted[:4], accepted, [0.7] * 4)
        r.observe("b", [1, 2, 3, 4], accepted, [0.95] * 4)  # confident and wrong
        r.observe("c", [accepted[0], 0, 0, 0], accepted, [0.5] * 4)
        r.record_round(4)
    assert r.select() == ["a"]
    assert r.ranking() == ["a", "c", "b"]
    assert r.scores()["b"] < 0.5 * r.scores()["a"]


def test_priors_are_calibrated_by_what_tried_drafters_earn_online():
    """Chat prompts are easy to predict (the template), so every prior is high; the specialist earns
    less online than its prior promised. The untried drafters' priors shrink by the same factor,
    so they do not overtake it just because they were never tried."""
    r = ExpertiseRouter(["specialist", "other1", "other2"], k=1, threshold=0.0)
    r.prior("specialist", fit(0.47, confidence=0.47))
    r.prior("other1", fit(0.38, confidence=0.38))
    r.prior("other2", fit(0.36, confidence=0.36))
    assert r.calibration() == 1.0
    for _ in range(6):  # it agrees on a quarter of its tokens: h ≈ 0.28, below the others' raw priors
        r.observe("specialist", [1, 9, 9, 9], [1, 2, 3, 4, 5], [0.3] * 4, context=[1, 2, 3, 4])
        r.record_round(1)
    assert r.scores()["specialist"] < 0.36  # raw, the others would now look better
    assert r.calibration() < 1.0
    assert r.select() == ["specialist"]
    assert r.ranking() == ["specialist", "other1", "other2"]


def test_old_evidence_decays():
    r = ExpertiseRouter(["a", "b"], k=1, decay=0.5)
    for _ in range(5):
        r.observe("a", [1, 2], [1, 2, 3], [0.9, 0.9])
        r.observe("b", [5, 6], [1, 2, 3], [0.9, 0.9])
    assert r.select() == ["a"]
    # the text changes: now only b agrees; with decay 0.5 a few rounds are enough to switch
    for _ in range(3):
        r.observe("a", [5, 6], [1, 2, 3], [0.9, 0.9])
        r.observe("b", [1, 2], [1, 2, 3], [0.9, 0.9])
    assert r.select() == ["b"]


def test_an_under_performing_request_explores_the_least_tried_drafter():
    r = ExpertiseRouter(["a", "b", "c", "d"], k=1, threshold=2.0)
    for name, rate in [("a", 0.5), ("b", 0.4), ("c", 0.4), ("d", 0.4)]:
        r.prior(name, fit(rate))
    assert r.select() == ["a"]  # no round yet: nothing to explore on
    # b and c have been tried (say earlier explorations) and did badly; d never
    r.observe("b", [1], [2, 3], [0.5])
    r.observe("c", [1], [2, 3], [0.5])
    r.observe("a", [2, 9, 9], [2, 3], [0.5] * 3)
    r.record_round(1)
    assert r.exploring()
    assert r.upper_bound("d") > r.upper_bound("b") and r.upper_bound("d") > r.scores()["a"]
    assert r.select() == ["a", "d"]
    # once the request does well it exploits only
    for _ in range(4):
        r.record_round(4)
    assert not r.exploring()
    assert r.select() == ["a"]


def test_exploration_skips_drafters_that_cannot_beat_the_one_in_use():
    r = ExpertiseRouter(["good", "weak", "hopeless"], k=1, threshold=3.0)
    r.prior("good", fit(0.5))
    r.prior("weak", fit(0.35))
    r.prior("hopeless", fit(0.0))
    for _ in range(6):  # good agrees on half its tokens, which is still below the accepted-length threshold
        r.observe("good", [1, 2, 3, 4], [1, 2, 9, 4, 5], [0.5] * 4)
        r.record_round(2)
    assert r.exploring()
    assert r.select() == ["good", "weak"]  # plausible: its bound is above good's score
    for _ in range(6):
        r.observe("weak", [7, 7], [1, 2, 3], [0.9, 0.9])  # tried, and wrong every time
        r.observe("good", [1, 2, 3, 4], [1, 2, 9, 4, 5], [0.5] * 4)
        r.record_round(2)
    assert r.exploring()
    assert r.upper_bound("hopeless") < r.scores()["good"] and r.upper_bound("weak") < r.scores()["good"]
    assert r.select() == ["good"]  # nothing left that could beat it: no round-robin over weak drafters


def test_exploration_with_equal_tries_prefers_the_better_score():
    r = ExpertiseRouter(["a", "b", "c"], k=1, threshold=1.0)
    r.prior("a", fit(0.3))
    r.prior("b", fit(0.1))
    r.prior("c", fit(0.25))
    r.record_round(0)
    assert r.select() == ["a", "c"]


def test_requested_drafters_override():
    r = ExpertiseRouter(["a", "b", "c"], k=2, threshold=5.0, requested=["c", "c"])
    r.prior("a", fit(0.6))
    r.record_round(0)
    assert r.select() == ["c"]


def test_state_round_trips():
    r = ExpertiseRouter(["a", "b"], k=1, threshold=1.5)
    r.prior("a", fit(0.3, mean_logprob=-2.0))
    r.observe_round({"a": ([1, 2], [0.8, 0.7]), "b": ([1, 3], [0.6, 0.6])}, accepted=[1, 2, 4], accepted_length=2)
    import json

    s = ExpertiseRouter.from_dict(json.loads(json.dumps(r.to_dict())))
    assert s.scores() == r.scores()
    assert s.select() == r.select()
    assert s.recent_accepted == r.recent_accepted == 2.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        ExpertiseRouter([])
    with pytest.raises(ValueError):
        ExpertiseRouter(["a"], k=0)
    with pytest.raises(KeyError, match="unknown drafter"):
        ExpertiseRouter(["a"]).observe("z", [1], [1], 1.0)


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d"]),
            st.lists(st.integers(0, 5), max_size=6),
            st.lists(st.integers(0, 5), min_size=1, max_size=7),
            st.floats(0, 1),
        ),
        max_size=20,
    ),
    k=st.integers(1, 4),
)
def test_scores_stay_in_unit_interval_and_selection_is_well_formed(rounds, k):
    r = ExpertiseRouter(["a", "b", "c", "d"], k=k, threshold=1.0)
    for name, drafted, accepted, conf in rounds:
        r.observe(name, drafted, accepted, conf)
        r.record_round(len(drafted) // 2)
    assert all(0.0 <= s <= 1.0 + 1e-12 for s in r.scores().values())
    chosen = r.select()
    assert len(chosen) == len(set(chosen))
    assert min(k, 4) <= len(chosen) <= min(k + 1, 4)
    assert chosen[: min(k, 4)] == r.ranking()[: min(k, 4)]
