"""Which replica of a role takes a new request: pure policy over the replicas' load reports.

`cosine.common.pool.EndpointPool` is the adapter: it polls every replica's `Load.Report`, counts the
requests it placed since each report, and asks `choose` for an index. A request then stays on the
replica it was placed on (its KV caches live there); only new requests are spread.

The rule, in order:

1. a replica with a free slot beats a full one (live + placed >= capacity);
2. fewer requests held, counting those placed since its report — as a share of its capacity when
   every candidate reports one (replicas of different sizes), else as a count;
3. less work queued on its model thread;
4. ties go round robin (``turn`` advances with every pick), so equal replicas take turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """One replica's report (`cosine.common.v1.LoadReport`) in the policy's terms."""

    live: int = 0  # requests it holds
    capacity: int = 0  # most it holds (0: no fixed bound)
    queued: int = 0  # work waiting or running on its model thread


@dataclass(frozen=True)
class Candidate:
    load: Load
    placed: int = 0  # requests this caller placed on it after its latest report was taken


def _key(candidate: Candidate, shares: bool) -> tuple:
    held = candidate.load.live + candidate.placed
    cap = candidate.load.capacity
    full = cap > 0 and held >= cap
    return (full, held / cap if shares else held, candidate.load.queued)


def choose(candidates: Sequence[Candidate], turn: int = 0) -> int:
    """Index of the candidate that takes the next request (see the module's rule). Raises ValueError
    when there is none."""
    if not candidates:
        raise ValueError("no candidates")
    shares = all(c.load.capacity > 0 for c in candidates)
    keys = [_key(c, shares) for c in candidates]
    best = min(keys)
    tied = [i for i, k in enumerate(keys) if k == best]
    return tied[turn % len(tied)]


def free_slots(candidates: Sequence[Candidate]) -> int | None:
    """Requests the candidates can take now: their capacities less every caller's requests on them (this
    caller's placed ones counted exactly, the others' as of their reports). None: not known, when there is
    no candidate or one reports no capacity (no fixed bound)."""
    if not candidates or any(c.load.capacity <= 0 for c in candidates):
        return None
    return sum(max(0, c.load.capacity - c.load.live - c.placed) for c in candidates)
