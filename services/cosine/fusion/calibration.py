"""Drafters' confidence calibrated online against what the target accepts (pure logic).

A drafter's stated probability for a token is what confidence fusion ranks candidates by and
what the scheduler's batch chooser and adaptive depth read from the tree. A small drafter is
often overconfident (`cosine zoo eval`: the untrained 2-layer LM states ~0.9 where ~0.35 is
accepted) and a model-free one underconfident, so their numbers are not comparable. Fusion
learns, per drafter, how often a token it stated probability p for turns out to be the
target's token, and ranks by that instead.

The method is histogram binning with a prior: the stated probability's bin maps to
``(hits + w * p) / (count + w)`` — the stated value while the bin has seen little, the observed
acceptance rate once it has seen much more than ``w``. A bin's counts are halved when they pass
``max_count``, so the map follows a drafter whose behaviour changes (another workload), and
memory is fixed: ``bins`` numbers per drafter.

What counts as an observation (`observe_round`): position i of a drafter's chain is judged when
the drafter's context before it was the committed text (its chain, or confidence fusion's fused
chain it continued from) and the target's token at i is known (committed has it). Only the
target's choice matters, so draft tokens never change the output — calibration changes which
drafts are proposed, never what is committed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Reliability:
    """Stated probabilities against outcomes, in equal-width bins over [0, 1]."""

    bins: int = 10
    stated: list[float] = field(default_factory=list)  # Σ stated probability per bin
    hits: list[float] = field(default_factory=list)
    count: list[float] = field(default_factory=list)
    max_count: float = 2000.0

    def __post_init__(self):
        for name in ("stated", "hits", "count"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.bins)

    def bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def add(self, p: float, hit: bool) -> None:
        b = self.bin(p)
        if self.count[b] >= self.max_count:  # forget the older half: the map follows a changing drafter
            self.stated[b] *= 0.5
            self.hits[b] *= 0.5
            self.count[b] *= 0.5
        self.stated[b] += p
        self.hits[b] += 1.0 if hit else 0.0
        self.count[b] += 1.0

    @property
    def total(self) -> float:
        return sum(self.count)

    def ece(self) -> float | None:
        """Expected calibration error: Σ_bins (n_b / N) |mean stated − observed rate| (None: nothing seen)."""
        n = self.total
        if n <= 0:
            return None
        return sum(abs(s - h) for s, h in zip(self.stated, self.hits)) / n


@dataclass
class Calibrator:
    """One drafter's map from stated probability to the acceptance rate observed for it."""

    bins: int = 10
    prior_weight: float = 8.0  # pseudo-observations at the stated probability
    raw: Reliability = None  # the drafter's own probabilities against outcomes
    mapped: Reliability = None  # the calibrated probabilities fusion used, against the same outcomes

    def __post_init__(self):
        self.raw = self.raw or Reliability(self.bins)
        self.mapped = self.mapped or Reliability(self.bins)

    def __call__(self, p: float) -> float:
        b = self.raw.bin(p)
        return (self.raw.hits[b] + self.prior_weight * p) / (self.raw.count[b] + self.prior_weight)

    def observe(self, p: float, hit: bool, used: float | None = None) -> None:
        """``used``: the probability fusion ranked the token by (default: this map's value for p now, close to
        the one it had when the token was proposed)."""
        self.mapped.add(self(p) if used is None else used, hit)
        self.raw.add(p, hit)


class CalibrationTable:
    """A calibrator per drafter name; `enabled=False` keeps learning (for the metrics) but maps nothing."""

    def __init__(self, enabled: bool = True, bins: int = 10, prior_weight: float = 8.0):
        self.enabled = enabled
        self.bins, self.prior_weight = bins, prior_weight
        self.drafters: dict[str, Calibrator] = {}

    def of(self, name: str) -> Calibrator:
        cal = self.drafters.get(name)
        if cal is None:
            cal = self.drafters[name] = Calibrator(self.bins, self.prior_weight)
        return cal

    def map(self, name: str, p: float) -> float:
        return self.of(name)(p) if self.enabled else p

    def map_all(self, name: str, probs: Sequence[float]) -> list[float]:
        return [self.map(name, p) for p in probs]

    def observe_round(self, chains: Mapping[str, tuple[Sequence[int], Sequence[float]]], committed: Sequence[int],
                      context: Sequence[int] | None = None) -> None:
        """Judge a round's chains (drafter → (tokens, stated probabilities)) by the tokens committed after it.

        ``context``: the chain every drafter continued from (confidence fusion's fused chain); None when
        each drafted its own chain. Position i counts when the context before it is committed[:i]."""
        for name, (tokens, probs) in chains.items():
            ctx = tokens if context is None else context
            cal = self.of(name)
            for i, (token, p) in enumerate(zip(tokens, probs)):
                if i >= len(committed) or (i > 0 and (i - 1 >= len(ctx) or ctx[i - 1] != committed[i - 1])):
                    break
                cal.observe(p, token == committed[i], used=None if self.enabled else p)
