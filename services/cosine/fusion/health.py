"""Fusion's view of its drafters' health (pure logic: no gRPC, the clock is passed in).

A drafter's failure is never a request's: fusion drops a drafter that fails, hangs
past its step deadline or has no free slot, for that request, and drafts with the
rest (or not at all: plain decoding). This module decides

- how long one call to a drafter may take: ``factor`` × the drafter's measured time
  per drafted position × the positions asked for, never less than ``floor_s``; a
  request's first call also prefills its prompt, so it gets at least ``first_s``;
- which drafters new requests use: after ``failures_to_skip`` failures in a row a
  drafter is skipped; after a backoff (doubling up to ``max_backoff_s`` while it
  keeps failing) it is probed (a health check, not a live request), and re-admitted
  when the probe passes.

A full drafter (no free KV slot) is alive: it is dropped for the request that found
it full, but its health does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HealthConfig:
    failures_to_skip: int = 3  # failures in a row that make new requests skip a drafter
    backoff_s: float = 2.0  # first wait before a skipped drafter is probed
    max_backoff_s: float = 30.0
    floor_s: float = 1.0  # shortest deadline of one call
    factor: float = 5.0  # deadline = factor × measured seconds per position × positions
    first_s: float = 10.0  # shortest deadline of a request's first call (it prefills the prompt)
    alpha: float = 0.2  # weight of the newest measurement in the moving average


@dataclass
class _State:
    failures: int = 0  # in a row
    skipped_until: float | None = None  # None: in use
    backoff_s: float = 0.0
    probing: bool = False
    per_position_s: float | None = None  # moving average of seconds per drafted position


@dataclass
class HealthView:
    names: list[str]
    config: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        self._state = {n: _State() for n in self.names}

    # -- what new requests use ---------------------------------------------------------

    def usable(self, name: str) -> bool:
        return self._state[name].skipped_until is None

    def skipped(self) -> list[str]:
        return [n for n in self.names if not self.usable(n)]

    def probes_due(self, now: float) -> list[str]:
        """Skipped drafters whose backoff is over and that no probe is checking yet; each is marked probing."""
        due = []
        for name, s in self._state.items():
            if s.skipped_until is not None and not s.probing and now >= s.skipped_until:
                s.probing = True
                due.append(name)
        return due

    def probe_result(self, name: str, ok: bool, now: float) -> None:
        s = self._state[name]
        s.probing = False
        if ok:
            self._state[name] = _State(per_position_s=s.per_position_s)  # re-admitted; its speed is still known
        else:
            s.backoff_s = min(s.backoff_s * 2, self.config.max_backoff_s)
            s.skipped_until = now + s.backoff_s

    # -- what calls report ------------------------------------------------------------------

    def deadline(self, name: str, positions: int, first: bool = False) -> float:
        c = self.config
        per = self._state[name].per_position_s
        limit = c.floor_s if per is None else max(c.floor_s, c.factor * per * max(positions, 1))
        if first or per is None:
            limit = max(limit, c.first_s)
        return limit

    def success(self, name: str, seconds: float | None = None, positions: int = 1) -> None:
        """A call answered; ``seconds`` (None: not a measure of step time, say a prefill) feeds the average."""
        s = self._state[name]
        s.failures = 0
        if seconds is not None:
            per = seconds / max(positions, 1)
            s.per_position_s = per if s.per_position_s is None else (1 - self.config.alpha) * s.per_position_s + self.config.alpha * per

    def failure(self, name: str, now: float) -> bool:
        """A call failed or timed out; True when this makes new requests skip the drafter."""
        s = self._state[name]
        s.failures += 1
        if s.skipped_until is None and s.failures >= self.config.failures_to_skip:
            s.backoff_s = self.config.backoff_s
            s.skipped_until = now + s.backoff_s
            return True
        return False
