"""Expertise routing (DESIGN §2): which drafters draft for one request (pure logic).

One `ExpertiseRouter` lives per request. It keeps a score per candidate drafter
in [0, 1] that estimates how useful that drafter is *for this request*:

* **Prior** — `prior(name, fit)`: how well the drafter predicted the request's
  own prompt while it prefilled it (`PromptFit`, teacher-forced: at every
  prompt position its most probable next token against the prompt's next
  token). It enters as a pseudo observation of value ``h(confidence,
  hit rate)`` — the online score below, computed on the prompt — weighted by
  the positions scored, at most ``prior_weight``. The drafter's mean
  log-probability of the prompt is kept too (``PromptFit.mean_logprob``) and
  breaks ties: it measures how well the drafter models the prompt's *text*,
  while acceptance needs its most probable token to be the target's, which
  the hit rate measures on the same scale as the online agreement — so prior
  and evidence can be averaged. (Both pick the right domain specialist for
  38–39 of 40 held-out zoo prompts; only the hit rate can rank an n-gram
  drafter, which has no distribution, against the LMs.)

* **Online update** — `observe(name, drafted, accepted, confidence)` after each
  verification. Two numbers in [0, 1] are combined by their harmonic mean
  ``h = 2·c·a / (c + a)`` (high only when *both* are high: a drafter that is
  confidently wrong, or right by luck with low confidence, scores low):

  - ``c``, **confidence**: the mean probability the drafter gave its own drafted
    tokens;
  - ``a``, **agreement**: the fraction of its drafted tokens that equal the
    target's token at the same position, counted only at positions where the
    drafter's context was the target's (see `agreement`). This is the
    maximum-likelihood estimate of the drafter's per-token acceptance rate α
    under greedy/point-mass verification, and α is exactly what sets the
    expected accepted length ``(1 − α^(d+1)) / (1 − α)`` of its drafts.
    We use it instead of the cosine similarity of token embeddings because
    drafters and target share one tokenizer and verification accepts a token
    only if it is *identical* to the target's: embedding similarity gives
    partial credit to near-synonyms that the target rejects, and depends on an
    embedding table that not every drafter kind (n-gram) has.

  Evidence decays exponentially: each new observation multiplies the drafter's
  accumulated evidence (prior included) by ``decay`` before adding
  ``h · w`` with weight ``w`` = number of scored positions (at least 1, so a
  drafter that proposed nothing is penalised). The score is the weighted mean,
  with every prior scaled by `calibration` — what the drafters tried so far
  earned online relative to their priors — so the prior ranks drafters while
  the rounds set its scale.

* **Explore/exploit** — `select()`: the top-``k`` drafters by score; when the
  request's recent accepted length (an EMA over rounds, `record_round`) falls
  below ``threshold``, also one drafter outside the top-k — the one with the
  highest upper confidence bound ``score + explore · sqrt(ln(1 + W) / (1 + w))``
  (``w`` its evidence weight, prior included, ``W`` everyone's): the less
  tried, the larger the bonus (ties: fewer tries, then the ranking) — and only
  if that bound beats the score of the k-th drafter, i.e. only a drafter that
  could still be better than one in use. (Adding the least-tried one whenever
  the request under-performs turned a uniformly weak pool into round-robin:
  with one drafter per round the domain's specialist drafted only 18–38 % of
  the rounds its own prior had given it.) Drafters the request named itself
  (``speculation.drafters``) override all of this.

The whole state round-trips through `to_dict` / `from_dict` (JSON-safe), so a
scheduler can keep it in Redis with the request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from cosine.engine.prompt_fit import PromptFit, harmonic


@dataclass
class DrafterEvidence:
    """What the router knows about one drafter for one request."""

    name: str
    online_sum: float = 0.0  # Σ decayᵃᵍᵉ · h · w over the rounds it drafted
    online_weight: float = 0.0  # Σ decayᵃᵍᵉ · w
    tries: int = 0  # rounds this drafter drafted for the request
    prior: float | None = None  # PromptFit.value, when known
    prior_weight: float = 0.0  # the prior's weight, decayed with every observation like old evidence
    prompt_logprob: float | None = None  # mean log-prob of the prompt (tie-breaker), when known
    last_confidence: float = 0.0
    last_agreement: float = 0.0

    def score(self, calibration: float = 1.0) -> float:
        """Decayed weighted mean of the (calibrated) prior and the online evidence; 0 with none at all."""
        prior = (self.prior or 0.0) * calibration
        weight = self.prior_weight + self.online_weight
        return (prior * self.prior_weight + self.online_sum) / weight if weight > 0 else 0.0


def agreement(drafted: Sequence[int], accepted: Sequence[int], context: Sequence[int] | None = None) -> tuple[int, int]:
    """(matches, scored positions) of a drafter's tokens against the target's.

    ``drafted[i]`` is the drafter's proposal for position i of the round;
    ``accepted`` the tokens the target committed this round (the accepted drafts
    followed by the bonus token), so the target's token is known at positions
    ``0 .. len(accepted) - 1``. ``context`` is the chain the drafter was
    conditioned on while drafting: ``None`` for a drafter drafting on its own
    (merge-only fusion, single drafter), the fused chain for step-wise fusion.
    Position i is scored only while ``context[:i] == accepted[:i]`` — elsewhere
    the drafter answered a question the target was never asked, and its token
    says nothing about its skill.
    """
    ctx = list(drafted) if context is None else list(context)
    matches = scored = 0
    for i, tok in enumerate(drafted):
        if i >= len(accepted) or (i > 0 and (i - 1 >= len(ctx) or ctx[i - 1] != accepted[i - 1])):
            break
        scored += 1
        matches += int(tok == accepted[i])
    return matches, scored


class ExpertiseRouter:
    """Scores per drafter for one request, and the drafters it should use next round.

    ``drafters``: the candidates, in a fixed order that breaks every tie.
    ``k``: how many to exploit. ``threshold``: recent accepted length (draft
    tokens accepted per round, EMA with ``length_alpha``) below which one
    less-tried drafter is added. ``decay`` in (0, 1]: weight kept by old
    evidence at each new observation. ``requested``: drafters the request named;
    when non-empty `select` returns exactly them.
    """

    def __init__(
        self,
        drafters: Iterable[str],
        k: int = 2,
        threshold: float = 1.0,
        decay: float = 0.8,
        prior_weight: float = 8.0,
        length_alpha: float = 0.5,
        explore: float = 0.25,
        requested: Iterable[str] = (),
    ):
        names = list(dict.fromkeys(drafters))
        if not names:
            raise ValueError("expertise routing needs at least one drafter")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0 < length_alpha <= 1:
            raise ValueError(f"length_alpha must be in (0, 1], got {length_alpha}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.k = k
        self.threshold = threshold
        self.decay = decay
        self.prior_weight = prior_weight
        self.length_alpha = length_alpha
        if explore < 0:
            raise ValueError(f"explore must be >= 0, got {explore}")
        self.explore = explore
        self.requested = list(dict.fromkeys(requested))
        self.evidence: dict[str, DrafterEvidence] = {n: DrafterEvidence(n) for n in names}
        self.recent_accepted: float | None = None  # EMA of accepted length; None before the first round
        self.rounds = 0

    @property
    def drafters(self) -> list[str]:
        return list(self.evidence)

    def _get(self, name: str) -> DrafterEvidence:
        try:
            return self.evidence[name]
        except KeyError:
            raise KeyError(f"unknown drafter {name!r}; candidates: {self.drafters}") from None

    def prior(self, name: str, fit: PromptFit) -> float:
        """Set the drafter's prior from how it predicted the prompt; returns its score."""
        if fit.positions < 0 or not 0 <= fit.hits <= fit.positions:
            raise ValueError(f"bad prompt fit {fit}")
        if fit.logprob_sum is not None and math.isnan(fit.logprob_sum):
            raise ValueError("prompt log-prob is NaN")
        ev = self._get(name)  # a new prior replaces an earlier one
        ev.prior = fit.value
        ev.prior_weight = float(min(fit.positions, self.prior_weight))
        ev.prompt_logprob = fit.mean_logprob
        return self.score(name)

    def calibration(self) -> float:
        """How much of their prompt score the drafters tried so far earn online (1 before any round).

        Predicting a prompt is easier or harder than predicting the target's continuation of it
        (a chat template is easy), and equally so for every drafter: the prior ranks drafters, its
        scale is set by the rounds. Σ online evidence / Σ prior × online weight over drafters with
        both, clipped to [0.1, 10]; every prior is scaled by it, so an untried drafter's prompt
        score does not look better than a tried one's just because prompts were easy."""
        num = den = 0.0
        for ev in self.evidence.values():
            if ev.prior is not None and ev.online_weight > 0:
                num += ev.online_sum
                den += ev.prior * ev.online_weight
        if den <= 1e-9:
            return 1.0
        return min(10.0, max(0.1, num / den))

    def score(self, name: str) -> float:
        return self._get(name).score(self.calibration())

    def observe(
        self,
        name: str,
        drafted: Sequence[int],
        accepted: Sequence[int],
        confidence: float | Sequence[float],
        context: Sequence[int] | None = None,
    ) -> float:
        """Fold one verification into the drafter's score; returns the new score.

        ``confidence``: the drafter's probabilities of its drafted tokens (or
        their mean). ``accepted`` and ``context`` as in `agreement`.
        """
        ev = self._get(name)
        if isinstance(confidence, (int, float)):
            c = float(confidence)
        else:
            probs = list(confidence)
            c = sum(probs) / len(probs) if probs else 0.0
        c = min(1.0, max(0.0, c))
        matches, scored = agreement(drafted, accepted, context)
        a = matches / scored if scored else 0.0
        h = harmonic(c, a) if drafted else 0.0
        w = max(1, scored)
        ev.online_sum = ev.online_sum * self.decay + h * w
        ev.online_weight = ev.online_weight * self.decay + w
        ev.prior_weight *= self.decay
        ev.tries += 1
        ev.last_confidence, ev.last_agreement = c, a
        return self.score(name)

    def record_round(self, accepted_length: int) -> float:
        """The request's accepted draft tokens this round (bonus excluded); returns the EMA."""
        if accepted_length < 0:
            raise ValueError(f"accepted_length must be >= 0, got {accepted_length}")
        if self.recent_accepted is None:
            self.recent_accepted = float(accepted_length)
        else:
            self.recent_accepted += self.length_alpha * (accepted_length - self.recent_accepted)
        self.rounds += 1
        return self.recent_accepted

    def observe_round(
        self,
        drafts: Mapping[str, tuple[Sequence[int], Sequence[float]]],
        accepted: Sequence[int],
        accepted_length: int,
        context: Sequence[int] | None = None,
    ) -> None:
        """`observe` every drafter of a round, then `record_round` once."""
        for name, (tokens, probs) in drafts.items():
            self.observe(name, tokens, accepted, probs, context)
        self.record_round(accepted_length)

    def scores(self) -> dict[str, float]:
        cal = self.calibration()
        return {n: ev.score(cal) for n, ev in self.evidence.items()}

    def ranking(self) -> list[str]:
        """All drafters, best score first (ties: the higher prompt log-prob, then the given order)."""
        order = {n: i for i, n in enumerate(self.evidence)}
        scores = self.scores()

        def key(n):
            ev = self.evidence[n]
            return -scores[n], -(ev.prompt_logprob if ev.prompt_logprob is not None else -math.inf), order[n]
        return sorted(self.evidence, key=key)

    def exploring(self) -> bool:
        """Whether the request is under-performing (recent accepted length below the threshold)."""
        return self.recent_accepted is not None and self.recent_accepted < self.threshold

    def upper_bound(self, name: str) -> float:
        """The drafter's score plus its exploration bonus (larger the less evidence it has)."""
        total = sum(ev.prior_weight + ev.online_weight for ev in self.evidence.values())
        ev = self._get(name)
        return self.score(name) + self.explore * math.sqrt(math.log1p(total) / (1.0 + ev.prior_weight + ev.online_weight))

    def select(self) -> list[str]:
        """The drafters for the next round: requested ones, else top-k (+ one worth exploring when under-performing)."""
        if self.requested:
            return list(self.requested)
        ranking = self.ranking()
        chosen = ranking[: self.k]
        if self.exploring():
            rest = [n for n in ranking if n not in chosen]  # already best score first, then given order
            if rest:
                pick = max(rest, key=lambda n: (self.upper_bound(n), -self.evidence[n].tries, -rest.index(n)))
                if self.upper_bound(pick) > self.score(chosen[-1]):
                    chosen.append(pick)
        return chosen

    def to_dict(self) -> dict:
        """JSON-safe state (settings included)."""
        return {
            "k": self.k, "threshold": self.threshold, "decay": self.decay, "prior_weight": self.prior_weight, "explore": self.explore,
            "length_alpha": self.length_alpha, "requested": self.requested,
            "recent_accepted": self.recent_accepted, "rounds": self.rounds,
            "evidence": [asdict(ev) for ev in self.evidence.values()],
        }

    @classmethod
    def from_dict(cls, state: Mapping) -> "ExpertiseRouter":
        router = cls(
            [ev["name"] for ev in state["evidence"]], k=state["k"], threshold=state["threshold"], decay=state["decay"],
            prior_weight=state["prior_weight"], length_alpha=state["length_alpha"], requested=state["requested"],
            explore=state.get("explore", 0.25),
        )
        router.recent_accepted = state["recent_accepted"]
        router.rounds = state["rounds"]
        router.evidence = {ev["name"]: DrafterEvidence(**ev) for ev in state["evidence"]}
        return router
