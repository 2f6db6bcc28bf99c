"""Acceptance arithmetic for drafter evaluation (pure logic).

Greedy drafting along the target's own greedy output needs one teacher-forced
pass per drafter: while a drafter's proposals match the target's tokens its
context is the true context, so the tokens accepted at position p with depth d
are min(d, the run of consecutive positions from p where the drafter's top-1
equals the target's token). The first mismatch ends the round either way.
"""

from __future__ import annotations

from collections.abc import Sequence


def match_runs(matches: Sequence[bool]) -> list[int]:
    """runs[p] = number of consecutive True values starting at p."""
    runs = [0] * (len(matches) + 1)
    for p in range(len(matches) - 1, -1, -1):
        runs[p] = runs[p + 1] + 1 if matches[p] else 0
    return runs[:-1]


def tau(matches: Sequence[bool], depth: int) -> float:
    """Mean tokens per round (accepted drafts + the target's own token) over a whole output, greedy.

    matches[p]: the drafter's top-1 at output position p, given the target's tokens before p,
    equals the target's token at p.
    """
    if depth < 0:
        raise ValueError("depth must be >= 0")
    n = len(matches)
    if n == 0:
        return 0.0
    runs = match_runs(matches)
    p = rounds = 0
    while p < n:
        accepted = min(depth, runs[p], n - p - 1)
        p += accepted + 1
        rounds += 1
    return n / rounds


def predicted_speedup(tau_value: float, depth: int, cost_ratio: float, verify_ratio: float) -> float:
    """The analytical bound tau / (depth * c + v): c = a draft step, v = verifying depth+1 tokens,
    both as fractions of one plain target decode step."""
    denom = depth * cost_ratio + verify_ratio
    if denom <= 0:
        raise ValueError("costs must be positive")
    return tau_value / denom


def calibration(confidences: Sequence[float], correct: Sequence[bool], bins: int = 10) -> dict:
    """How well a drafter's probabilities predict acceptance: a reliability table and its expected
    calibration error (ECE).

    ``confidences[i]``: the probability the drafter gave the token it proposed at a position it reached
    with the target's context; ``correct[i]``: whether that token was the target's (accepted there).
    Positions are binned by confidence into ``bins`` equal-width bins; for each non-empty bin the mean
    confidence and the acceptance rate. ECE = Σ (n_bin / n) · |acceptance − mean confidence|; 0 is a
    perfectly calibrated drafter. ``over`` > 0 means the drafter is overconfident on average (its mean
    probability exceeds its acceptance rate).
    """
    if len(confidences) != len(correct):
        raise ValueError("confidences and correct differ in length")
    if bins < 1:
        raise ValueError("bins must be >= 1")
    n = len(confidences)
    if n == 0:
        return {"positions": 0, "ece": None, "mean_confidence": None, "acceptance": None, "over": None, "bins": []}
    sums = [[0, 0.0, 0] for _ in range(bins)]  # n, Σ confidence, Σ correct
    for c, ok in zip(confidences, correct):
        c = min(1.0, max(0.0, float(c)))
        b = sums[min(bins - 1, int(c * bins))]
        b[0] += 1
        b[1] += c
        b[2] += int(bool(ok))
    table, ece = [], 0.0
    for i, (k, conf, hits) in enumerate(sums):
        if not k:
            continue
        mean_conf, rate = conf / k, hits / k
        ece += k / n * abs(rate - mean_conf)
        table.append({"lo": i / bins, "hi": (i + 1) / bins, "n": k, "confidence": round(mean_conf, 4), "acceptance": round(rate, 4)})
    mean_conf = sum(min(1.0, max(0.0, float(c))) for c in confidences) / n
    rate = sum(bool(x) for x in correct) / n
    return {"positions": n, "ece": round(ece, 4), "mean_confidence": round(mean_conf, 4), "acceptance": round(rate, 4),
            "over": round(mean_conf - rate, 4), "bins": table}
