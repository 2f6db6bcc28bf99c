"""Adaptive speculation control (DESIGN §2): how far each request speculates (pure logic).

**Acceptance model.** Each request's per-token acceptance rate α is estimated
from its rounds: a round that drafted d tokens and had a accepted made
``a + (1 if a < d else 0)`` acceptance trials with ``a`` successes (drafts are
accepted as a prefix, so the first rejection ends the trials). ``α̂ = Σ
successes / Σ trials`` is the maximum-likelihood estimate of α under i.i.d.
per-token acceptance; both sums decay exponentially (``decay``) so the estimate
follows the request as its text changes. With α, a chain of depth d commits on
average ``τ(d) = (1 − α^(d+1)) / (1 − α)`` tokens per round (accepted + bonus;
``τ(0) = 1`` is plain decoding).

**Does speculation pay?** A round of depth d costs ``d·c + v(d)`` (c: one draft
step, v(d): a verification of d+1 positions; with pipelining the drafting
hides behind verification of another group and the cost is ``max(d·c, v(d))``).
A round that drafts at all also pays a fixed ``draft_overhead_s`` (the
round trip to the drafters and their prefill of the newly committed tokens).
`best_depth` maximises tokens per second ``τ(d) / cost(d)`` over
``0..max_depth`` and returns 0 — plain decoding through the verifier — unless
the best depth beats d = 0 by ``margin``. So speculation is never chosen when
the measured costs say it makes the server slower.

**Per request.** `RequestSpeculation` holds α̂ and an EMA of accepted length;
its depth is `best_depth` under the current costs, capped by the controller's
global cap and by the request's own ``max_depth``; its tree budget adds side
nodes in proportion to the uncertainty ``1 − α̂`` (a confident drafter needs a
chain, an unsure one benefits from alternatives).

**Globally.** `SpeculationController.update_load` reads the verifier's idle
fraction and queue depth: idle (idle ≥ ``idle_high`` and an empty queue) → grow,
first the depth cap (by ``step``, up to ``max_depth``), then the number of
drafters (up to ``max_drafters``); backed up (queue ≥ ``queue_high``) → shrink in
the reverse order, first drafters (down to 1), then depth, down to 0. Between
the thresholds nothing changes (hysteresis).

**For the server as a whole.** `SpeculationGate` measures, per load, whether rounds
that draft commit more tokens per second *for all requests together* than plain
decoding does, in alternating windows of wall time, and lets adaptive requests
draft only where it has: the per-request model above cannot see the CPU the
drafters take from the verifier on shared cores, nor the steps a drafting request
misses.

**Cap.** `shorten_longest_first` cuts a batch's speculation to a cap on draft
tokens by taking one token at a time from the currently longest (ties: the
later request in the given order), so short speculations, which are the most
likely to be fully accepted, are kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cosine.common.batching import shorten_longest_first


def expected_tokens(alpha: float, depth: int) -> float:
    """τ(depth): expected tokens committed by a chain round (accepted + bonus) at acceptance rate alpha."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    alpha = min(1.0, max(0.0, alpha))
    if alpha >= 1.0:
        return float(depth + 1)
    return (1.0 - alpha ** (depth + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class SpeculationCosts:
    """Measured costs: one draft step (the slowest drafter's) and a verification of n positions."""

    draft_step_s: float
    verify_s: float  # verification of one position (depth 0)
    verify_per_token_s: float = 0.0  # extra per drafted token verified
    pipelined: bool = False  # drafting overlaps verification
    draft_overhead_s: float = 0.0  # fixed cost of a round that drafts at all (round trips, prefill)

    def round_s(self, depth: int) -> float:
        v = self.verify_s + self.verify_per_token_s * depth
        d = self.draft_step_s * depth + (self.draft_overhead_s if depth > 0 else 0.0)
        return max(d, v) if self.pipelined else d + v

    @classmethod
    def from_models(cls, draft: Callable[[int], float], verify: Callable[[int], float], pipelined: bool = False) -> "SpeculationCosts":
        """From time models: ``draft(d)`` a round of d steps, ``verify(d)`` a tree of d nodes (linear in d)."""
        v0, v1 = verify(0), verify(1)
        return cls(max(0.0, draft(1) - draft(0)), v0, max(0.0, v1 - v0), pipelined)


def best_depth(alpha: float, costs: SpeculationCosts, max_depth: int, margin: float = 0.05) -> int:
    """Depth in 0..max_depth with the most tokens per second; 0 unless it beats plain decoding by ``margin``."""
    plain = 1.0 / costs.round_s(0) if costs.round_s(0) > 0 else math.inf
    best, best_rate = 0, plain
    for d in range(1, max(0, max_depth) + 1):
        t = costs.round_s(d)
        rate = expected_tokens(alpha, d) / t if t > 0 else math.inf
        if rate > best_rate:
            best, best_rate = d, rate
    if best and not best_rate > plain * (1.0 + margin):
        return 0
    return best


@dataclass
class RequestSpeculation:
    """One request's acceptance statistics and the depth/budget they call for."""

    max_depth: int = 8
    decay: float = 0.8
    length_alpha: float = 0.5
    successes: float = 0.0
    trials: float = 0.0
    accepted_ema: float | None = None
    prior_alpha: float = 0.6  # belief before any round
    prior_weight: float = 2.0  # trials the prior counts for; decays like real evidence

    def __post_init__(self) -> None:
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")
        if not 0 < self.decay <= 1 or not 0 < self.length_alpha <= 1:
            raise ValueError("decay and length_alpha must be in (0, 1]")
        if not 0 <= self.prior_alpha <= 1:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if self.successes == 0 and self.trials == 0:  # fresh: the prior is the first (pseudo) evidence
            self.successes, self.trials = self.prior_alpha * self.prior_weight, float(self.prior_weight)

    @property
    def alpha(self) -> float:
        """Per-token acceptance rate estimate (successes / trials, the prior included)."""
        return self.successes / self.trials if self.trials > 0 else self.prior_alpha

    def observe(self, drafted: int, accepted: int) -> None:
        """One verified round: ``drafted`` chain length (main chain), ``accepted`` draft tokens accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
        if drafted == 0:
            return  # plain decoding says nothing about drafting
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + (1 if accepted < drafted else 0)
        if self.accepted_ema is None:
            self.accepted_ema = float(accepted)
        else:
            self.accepted_ema += self.length_alpha * (accepted - self.accepted_ema)

    def depth(self, costs: SpeculationCosts | None, cap: int | None = None, margin: float = 0.05) -> int:
        """Depth for the next round: `best_depth` (or, without costs, the cap), within max_depth and cap."""
        limit = self.max_depth if cap is None else min(self.max_depth, cap)
        if limit <= 0:
            return 0
        if costs is None:
            return limit
        return best_depth(self.alpha, costs, limit, margin)

    def budget(self, depth: int, branching: float = 1.0, max_budget: int | None = None) -> int:
        """Tree nodes for a round of ``depth``: the chain plus ``round(depth·branching·(1 − α̂))`` side nodes."""
        if depth <= 0:
            return 0
        n = depth + round(depth * branching * (1.0 - self.alpha))
        return n if max_budget is None else max(0, min(n, max_budget))


@dataclass
class SpeculationController:
    """Global depth cap and drafter count, moved by the verifier's load (see the module docstring)."""

    max_depth: int = 8
    max_drafters: int = 3
    depth_cap: int = 4
    drafters: int = 1
    step: int = 1
    idle_high: float = 0.2  # verifier idle fraction at or above which we grow
    queue_high: int = 2  # verifier queue depth at or above which we shrink
    adaptive: bool = True  # off: fixed depth_cap/drafters

    def __post_init__(self) -> None:
        if self.max_depth < 0 or self.max_drafters < 1 or self.step < 1:
            raise ValueError("need max_depth >= 0, max_drafters >= 1, step >= 1")
        if not 0 <= self.depth_cap <= self.max_depth:
            raise ValueError(f"depth_cap must be in 0..{self.max_depth}, got {self.depth_cap}")
        if not 1 <= self.drafters <= self.max_drafters:
            raise ValueError(f"drafters must be in 1..{self.max_drafters}, got {self.drafters}")
        if not 0 <= self.idle_high <= 1 or self.queue_high < 1:
            raise ValueError("need 0 <= idle_high <= 1 and queue_high >= 1")

    def update_load(self, verifier_idle: float, verifier_queue: int) -> str:
        """Move the caps from one load reading; returns "grow", "shrink" or "hold"."""
        if not self.adaptive:
            return "hold"
        if verifier_queue >= self.queue_high:
            if self.drafters > 1:
                self.drafters -= 1
            elif self.depth_cap > 0:
                self.depth_cap = max(0, self.depth_cap - self.step)
            else:
                return "hold"
            return "shrink"
        if verifier_idle >= self.idle_high and verifier_queue == 0:
            if self.depth_cap < self.max_depth:
                self.depth_cap = min(self.max_depth, self.depth_cap + self.step)
            elif self.drafters < self.max_drafters:
                self.drafters += 1
            else:
                return "hold"
            return "grow"
        return "hold"

    def plan(
        self,
        requests: Mapping[str, RequestSpeculation],
        costs: SpeculationCosts | None,
        token_cap: int | None = None,
        margin: float = 0.05,
    ) -> dict[str, int]:
        """Depth per request this round: each request's own depth under the global cap, then the batch cap.

        ``token_cap`` caps Σ (1 + depth) — the verified positions of the group.
        Without ``adaptive`` every request gets the fixed cap (its max_depth permitting).
        """
        if self.adaptive:
            depths = {rid: r.depth(costs, self.depth_cap, margin) for rid, r in requests.items()}
        else:
            depths = {rid: min(r.max_depth, self.depth_cap) for rid, r in requests.items()}
        if token_cap is not None:
            depths = shorten_longest_first(depths, max(0, token_cap - len(depths)))
        return depths


def load_bucket(live: int) -> int:
    """Live requests rounded up to a power of two (1, 2, 4, 8, ...): loads compared as alike; 0 when idle."""
    return 0 if live <= 0 else 1 << (live - 1).bit_length()


@dataclass
class SpeculationGate:
    """Does speculation make *this server* faster at its present load? Measured, not modelled.

    The per-request cost model (`best_depth`) sees one request's rounds; it cannot see what
    speculation costs the others: on shared cores the drafters' forwards take CPU from the
    verifier, a request that drafts misses the step its neighbours go into, and a bigger tree
    makes every request's step slower. So the scheduler runs its time in windows of
    ``window_s`` seconds, each with speculation on or off for every adaptive request, and
    keeps, per load bucket (live requests rounded up to a power of two), an exponentially
    weighted mean of the tokens committed per second in each mode. A new window takes the
    better mode of its bucket (of the nearest bucket where both modes were measured, until
    both are measured at this one; with nothing measured anywhere, each mode once), and
    the ``explore_every``-th window of a bucket tries the other one, so the other mode
    gets measured and a change in the workload (better drafts, another mix) is noticed. Each
    exploration that leaves the judgement as it was doubles the wait for the next one at that
    bucket, up to ``max_explore_every`` windows; one that turns it resets the wait. What drafting is worth
    moves one way with load (more requests share each step's weights, so a drafted token saves less of a
    step and the drafters' forwards take more of the cores): where speculation lost at a lower load, or paid
    at a higher one, and this bucket's judgement agrees, the judgement is taken as confirmed and the first
    exploration there already waits ``max_explore_every`` windows. Speculation then
    runs where it has paid at this load and is off where it has not: at most one window in
    ``explore_every`` runs the losing mode, and fewer while the judgement holds (a losing mode
    costs its windows; 32 windows of 0.5 s notice a change within 16 s).
    A window whose load left its bucket, that committed fewer than ``min_tokens``, or that ran past
    twice its length (no adaptive request asked in between: the tokens were others', whatever the
    mode), teaches nothing. Times come from the caller's clock (pure code: it runs in simulation).
    """

    window_s: float = 0.5
    explore_every: int = 8
    max_explore_every: int = 32
    smoothing: float = 0.3
    min_tokens: int = 4
    rates: dict[int, dict[bool, float]] = field(default_factory=dict)  # bucket → mode (speculating?) → tokens/s
    windows: dict[int, int] = field(default_factory=dict)  # windows measured per bucket
    explorations: dict[int, tuple[int, int, bool]] = field(default_factory=dict)  # bucket → (next at, gap, judgement then)
    speculating: bool = True
    _started: float | None = None
    _bucket: int = 0
    _tokens: int = 0
    _mixed: bool = False

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.explore_every < 2 or not 0 < self.smoothing <= 1 or self.min_tokens < 0 \
                or self.max_explore_every < self.explore_every:
            raise ValueError("need window_s > 0, explore_every >= 2, max_explore_every >= explore_every, "
                             "0 < smoothing <= 1, min_tokens >= 0")

    def speculate(self, now: float, live: int) -> bool:
        """Whether rounds starting now may draft (``live``: requests the scheduler runs now)."""
        bucket = load_bucket(live)
        if self._started is None:
            self._begin(now, bucket)
        elif now - self._started >= self.window_s:
            self._close(now)
            self._begin(now, bucket)
        elif bucket != self._bucket:
            self._mixed = True
        return self.speculating

    def observe(self, tokens: int) -> None:
        """Tokens committed (by any request) in the current window."""
        self._tokens += max(0, tokens)

    def _close(self, now: float) -> None:
        elapsed = now - self._started
        if self._mixed or self._bucket == 0 or elapsed <= 0 or self._tokens < self.min_tokens:
            return
        if elapsed > 2 * self.window_s:  # no adaptive request planned a round for a while: its mode did not act
            return
        rate = self._tokens / elapsed
        modes = self.rates.setdefault(self._bucket, {})
        old = modes.get(self.speculating)
        modes[self.speculating] = rate if old is None else old + self.smoothing * (rate - old)
        self.windows[self._bucket] = self.windows.get(self._bucket, 0) + 1

    def _begin(self, now: float, bucket: int) -> None:
        self._started, self._bucket, self._tokens, self._mixed = now, bucket, 0, False
        self.speculating = self.choose(bucket)
        best = self._judgement(bucket)
        if best is not None and self.exploring(bucket):  # this window explores: when is the next one
            _, gap, then = self.explorations.get(bucket, (0, 0, None))
            gap = min(self.max_explore_every, gap * 2) if gap and then == best else self._first_gap(bucket, best)
            self.explorations[bucket] = (self.windows.get(bucket, 0) + gap, gap, best)

    def _first_gap(self, bucket: int, best: bool | None) -> int:
        """Windows before a bucket's first exploration (and after one that turned its judgement)."""
        return self.max_explore_every if self.confirmed(bucket, best) else self.explore_every

    def confirmed(self, bucket: int, best: bool | None) -> bool:
        """Whether judgement ``best`` at this bucket agrees with one measured at another load in the direction
        speculation's worth moves with load: it lost at a lower load, or paid at a higher one."""
        if best is None:
            return False
        for b, modes in self.rates.items():
            if b != bucket and len(modes) == 2 and (modes[True] >= modes[False]) == best and (b < bucket) != best:
                return True
        return False

    def _judgement(self, bucket: int) -> bool | None:
        """Whether speculating is the better mode at this bucket (at the nearest judged one until both modes are
        measured here; None: nothing judged anywhere yet)."""
        modes = self.rates.get(bucket, {})
        if len(modes) == 2:
            return modes[True] >= modes[False]
        return self._nearest_judged(bucket)

    def pays(self, live: int) -> bool | None:
        """Whether speculating has been the better mode at this load (None: nothing judged yet), exploration aside."""
        return self._judgement(load_bucket(live))

    def exploring(self, bucket: int) -> bool:
        """Whether the next window at this bucket runs the mode that is not the better one."""
        if bucket in self.explorations:
            due = self.explorations[bucket][0]
        else:
            due = self._first_gap(bucket, self._judgement(bucket)) - 1
        return self.windows.get(bucket, 0) >= due

    def choose(self, bucket: int) -> bool:
        """The mode of the next window at this load bucket."""
        best = self._judgement(bucket)
        if best is None:  # nothing judged anywhere yet: measure both modes here first
            return True not in self.rates.get(bucket, {})
        return (not best) if self.exploring(bucket) else best

    def _nearest_judged(self, bucket: int) -> bool | None:
        judged = [b for b, m in self.rates.items() if len(m) == 2]
        if not judged:
            return None
        b = min(judged, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))
        return self.rates[b][True] >= self.rates[b][False]

    def gain(self, bucket: int) -> float | None:
        """Speculating tokens/s over plain tokens/s at a bucket (None until both are measured)."""
        modes = self.rates.get(bucket, {})
        if True not in modes or False not in modes or modes[False] <= 0:
            return None
        return modes[True] / modes[False]
