"""What adaptive speculation control measures and how it turns measurements into depths (pure logic).

* `LinearFit` — exponentially weighted least squares ``y ≈ a + b·x``.
* `CostModel` — the costs `best_depth` needs, fitted from what the services report each
  round: fusion's ``draft_ms`` against the round's depth (a draft round costs
  ``overhead + c·d``: c is one step of the slowest drafter, the overhead the
  round trip and the prefill of newly committed tokens), the verifier's
  ``verify_ms`` against the tree's size (``v0 + v1·nodes``), and the rest of a
  round's wall time (the scheduler's own round trips and the Redis commit) as a
  per-round cost that speculation amortises. Drafting is fitted per configuration
  (fusion mode and number of drafters: confidence fusion exchanges a message per
  step, merging one per round). While all rounds had one depth the
  slope is not identifiable: drafting time is then put on the steps (c = mean /
  depth, no overhead — pessimistic for speculation) and verification time on the
  intercept (no per-node cost — verifying a few more positions is nearly free on
  the hardware we serve on).
* `LoadMeter` — the global controller's reading of the verifier's load, as seen from
  this scheduler: the fraction of wall time in which none of its requests was
  waiting on the verifier (idle), and how many were waiting when read (queue).
* `verifier_load` — that reading combined with the verifiers' own load reports, so several
  schedulers sharing a verifier each see the whole load.
* `DepthChooser` — a request's `RequestSpeculation` plus probing: a request whose
  depth is 0 (speculation does not pay) learns nothing about its acceptance, so
  after ``probe_every`` plain rounds it drafts ``probe_depth`` tokens to find out
  whether it pays again; each probe that does not pay doubles that wait (up to
  ``max_probe_every``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from cosine.scheduler.speculation import RequestSpeculation, SpeculationCosts


@dataclass
class LinearFit:
    decay: float = 0.95
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    n: int = 0  # observations, undecayed

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n += 1
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def means(self) -> tuple[float, float]:
        return (self.sx / self.w, self.sy / self.w) if self.w > 0 else (0.0, 0.0)

    def slope(self, min_spread: float = 0.25) -> float | None:
        """b, or None when x has (almost) no spread: the slope is not identifiable."""
        if self.w <= 0:
            return None
        mx, my = self.means()
        var = self.sxx / self.w - mx * mx
        if var < min_spread * min_spread:
            return None
        return (self.sxy / self.w - mx * my) / var


@dataclass
class CostModel:
    decay: float = 0.95
    min_rounds: int = 3  # draft and verify observations before costs are trusted
    drafts: dict[Hashable, LinearFit] = field(default_factory=dict)  # by drafting configuration
    verify: LinearFit = field(default_factory=LinearFit)
    overhead_s: float | None = None  # EMA of a round's wall time beyond draft and verify compute
    overhead_alpha: float = 0.1

    def __post_init__(self) -> None:
        self.verify.decay = self.decay

    def observe_draft(self, depth: int, seconds: float, key: Hashable = None) -> None:
        """One drafting round; ``key`` names its configuration (e.g. fusion mode and drafter count),
        which a round's cost depends on: each has its own fit."""
        if depth > 0 and seconds >= 0:
            self.drafts.setdefault(key, LinearFit(self.decay)).add(depth, seconds)

    def observe_verify(self, nodes: int, seconds: float) -> None:
        if nodes >= 0 and seconds >= 0:
            self.verify.add(nodes, seconds)

    def observe_overhead(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.overhead_s = seconds if self.overhead_s is None else self.overhead_s + self.overhead_alpha * (seconds - self.overhead_s)

    def costs(self, key: Hashable = None, pipelined: bool = False) -> SpeculationCosts | None:
        """The fitted costs of drafting configuration ``key``, or None until its draft fit and the
        verify fit have ``min_rounds`` observations each."""
        draft = self.drafts.get(key)
        if draft is None or draft.n < self.min_rounds or self.verify.n < self.min_rounds:
            return None
        mx, my = draft.means()
        c = draft.slope()
        if c is None or c <= 0:
            c, draft_overhead = (my / mx if mx > 0 else 0.0), 0.0
        else:
            draft_overhead = max(0.0, my - c * mx)
        vx, vy = self.verify.means()
        v1 = self.verify.slope()
        if v1 is None or v1 < 0:
            v0, v1 = vy, 0.0
        else:
            v0 = max(0.0, vy - v1 * vx)
        return SpeculationCosts(draft_step_s=max(0.0, c), verify_s=v0 + (self.overhead_s or 0.0), verify_per_token_s=v1,
                                pipelined=pipelined, draft_overhead_s=draft_overhead)


class LoadMeter:
    """Requests of this scheduler waiting on the verifier, over windows of wall time (times from the caller)."""

    def __init__(self, now: float):
        self.waiting = 0
        self.window_start = now
        self.busy_s = 0.0
        self._busy_since: float | None = None

    def enter(self, now: float) -> None:
        if self.waiting == 0:
            self._busy_since = now
        self.waiting += 1

    def leave(self, now: float) -> None:
        if self.waiting <= 0:
            raise ValueError("leave without enter")
        self.waiting -= 1
        if self.waiting == 0 and self._busy_since is not None:
            self.busy_s += now - max(self._busy_since, self.window_start)
            self._busy_since = None

    def read(self, now: float) -> tuple[float, int]:
        """(idle fraction of the window, requests waiting now); starts a new window."""
        busy = self.busy_s
        if self._busy_since is not None:
            busy += now - max(self._busy_since, self.window_start)
        elapsed = now - self.window_start
        idle = 1.0 - min(1.0, busy / elapsed) if elapsed > 0 else 0.0
        self.window_start, self.busy_s = now, 0.0
        return idle, self.waiting


def verifier_load(own_idle: float, own_queue: int, reports: list[tuple[float, int]]) -> tuple[float, int]:
    """(idle, queue) for the global controller: this scheduler's own reading (`LoadMeter`) combined with
    what the verifiers it uses report — (busy share, rounds not yet answered) each, other schedulers'
    requests included. A verifier is no idler than its model thread says, and its queue no shorter
    than either count (the mean over the verifiers: each verifies its own requests)."""
    if not reports:
        return own_idle, own_queue
    busy = sum(b for b, _ in reports) / len(reports)
    queued = sum(q for _, q in reports) / len(reports)
    return min(own_idle, 1.0 - busy), max(own_queue, round(queued))


@dataclass
class DepthChooser:
    """A request's depth each round: `RequestSpeculation`'s, plus probes while that is 0.

    A request at depth 0 learns nothing about its acceptance, so after ``probe_every`` plain rounds it
    drafts ``probe_depth`` tokens. A probe costs a drafting round (every drafter catches up on the tokens
    committed since it last drafted, then drafts) for what plain decoding gives in one, and on shared
    cores the drafters' forwards slow the verifier too. So each probe that leaves the depth at 0 doubles
    the wait before the next one, up to ``max_probe_every`` plain rounds; a round that drafts on its own
    merit (depth > 0) resets it. A request whose drafts do not pay costs a probe every 8, 16, 32, then 64
    rounds instead of every 8 for good; one whose drafts start paying is found at its next probe."""

    speculation: RequestSpeculation
    probe_every: int = 8
    probe_depth: int = 2
    max_probe_every: int = 64
    plain_rounds: int = 0
    interval: int = 0  # plain rounds before the next probe (0: probe_every)
    probed: bool = False  # the last round was a probe

    def count_plain(self, steps: int) -> None:
        """A decode run decoded ``steps`` further plain tokens in its one round: they count toward the next
        probe as the plain rounds they replace."""
        if steps > 0 and not self.probed:
            self.plain_rounds += steps

    def choose(self, costs: SpeculationCosts | None, cap: int | None = None) -> int:
        d = self.speculation.depth(costs, cap)
        limit = self.speculation.max_depth if cap is None else min(self.speculation.max_depth, cap)
        interval = self.interval or self.probe_every
        if d > 0 or limit <= 0:
            self.plain_rounds = 0
            if d > 0:  # drafting pays again: probe at the base rate when it stops paying
                self.interval, self.probed = self.probe_every, False
            return d
        if self.probed:  # the probe left the depth at 0: wait twice as long for the next
            interval = min(max(self.max_probe_every, self.probe_every), interval * 2)
            self.probed = False
        self.interval = interval
        self.plain_rounds += 1
        if self.plain_rounds >= interval:
            self.plain_rounds = 0
            self.probed = True
            return min(self.probe_depth, limit)
        return 0
