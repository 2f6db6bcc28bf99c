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
