"""What a drafter reports of a request's prompt for expertise routing's prior (pure, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


def harmonic(c: float, a: float) -> float:
    """Harmonic mean of two numbers in [0, 1] (0 when either is 0)."""
    return 0.0 if c <= 0 or a <= 0 else 2 * c * a / (c + a)


@dataclass(frozen=True)
class PromptFit:
    """How well a drafter predicted the prompt's next token at each of `positions` prompt positions."""

    positions: int
    hits: int  # positions where its most probable token was the prompt's next token
    confidence_sum: float  # Σ probability of its most probable token
    logprob_sum: float | None = None  # Σ log-probability of the prompt's next token; None: no distribution (n-gram)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.positions if self.positions else 0.0

    @property
    def confidence(self) -> float:
        return self.confidence_sum / self.positions if self.positions else 0.0

    @property
    def mean_logprob(self) -> float | None:
        return self.logprob_sum / self.positions if self.positions and self.logprob_sum is not None else None

    @property
    def value(self) -> float:
        """The online score's harmonic mean, on the prompt: h(confidence, hit rate)."""
        return harmonic(min(1.0, max(0.0, self.confidence)), self.hit_rate)
