"""Acceptance traces: what real requests' rounds accepted, per drafter and domain, recorded from a cluster.

A trace is recorded by running each drafter alone at a fixed depth D (fusion single, routing,
adaptive depth and pipelining off) over the workload's prompts through the router
(`record` — the benchmark's own client). The router streams one chunk per verification round,
so the chunks of a request are its rounds and ``len(chunk) - 1`` is the round's accepted draft
length (the last chunk, cut by max_new_tokens, is dropped).

Replay: the simulator's round k of a request drafted by drafter X at depth d accepts
``min(a, d)`` where a is entry (offset + k) of X's recorded sequence for the request's domain
(wrapping; the offset spreads requests over the trace). A drafter is deterministic given its
context, so the first d tokens of a depth-D chain are the depth-d chain: truncating is exact
for d ≤ D; for d > D a recorded D means "at least D" (the simulation under-counts there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class AcceptanceTrace:
    depth: int
    rounds: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # drafter → domain → accepted per round
    source: str = ""

    def sequence(self, drafter: str, domain: str) -> list[int]:
        per = self.rounds.get(drafter) or {}
        seq = per.get(domain)
        if not seq:  # an unrecorded domain: every domain of the drafter
            seq = [a for d in sorted(per) for a in per[d]]
        return seq or [0]

    def accepted(self, drafter: str, domain: str, index: int, depth: int) -> int:
        seq = self.sequence(drafter, domain)
        return max(0, min(seq[index % len(seq)], depth, self.depth))

    def alpha(self, drafter: str, domain: str | None = None) -> float:
        """Per-token acceptance rate of the recorded rounds (successes / trials at depth D)."""
        seq = self.sequence(drafter, domain) if domain else [a for d in self.rounds.get(drafter, {}).values() for a in d]
        trials = sum(a + (1 if a < self.depth else 0) for a in seq)
        return sum(seq) / trials if trials else 0.0

    def mean_accepted(self, drafter: str) -> float:
        seq = [a for d in self.rounds.get(drafter, {}).values() for a in d]
        return sum(seq) / len(seq) if seq else 0.0

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = asdict(self)
        rounds = doc.pop("rounds")
        lines = [f'{{"depth": {self.depth}, "source": {json.dumps(self.source)}, "rounds": {{']
        lines.append(",\n".join(f" {json.dumps(d)}: {json.dumps(per)}" for d, per in rounds.items()))
        lines.append("}}")
        path.write_text("\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: Path) -> "AcceptanceTrace":
        return cls(**json.loads(Path(path).read_text()))


def rounds_of(token_times_s: list[float]) -> list[int]:
    """Tokens per round of one streamed request: the client stamps every token of a chunk with the chunk's arrival."""
    out: list[int] = []
    last = None
    for t in token_times_s:
        if out and t == last:
            out[-1] += 1
        else:
            out.append(1)
        last = t
    return out


def from_records(records_by_drafter: dict, depth: int, source: str) -> AcceptanceTrace:
    """records_by_drafter: drafter → the bench client's RequestRecords of its fixed-depth run."""
    trace = AcceptanceTrace(depth, {}, source)
    for drafter, records in records_by_drafter.items():
        per: dict[str, list[int]] = {}
        for r in records:
            if r.error:
                continue
            sizes = rounds_of(r.token_times_s)[:-1]  # the last round is cut by the token limit
            per.setdefault(r.domain, []).extend(max(0, min(s - 1, depth)) for s in sizes)
        trace.rounds[drafter] = per
    return trace


def record(router_address: str, workload, drafters: list[str], depth: int, max_new: int, bar=None) -> tuple[AcceptanceTrace, dict]:
    """Each drafter alone at fixed depth over every prompt (concurrency 1); the trace and the raw records."""
    from cosine.bench import client
    from cosine.bench.compare import sweep_speculation

    raw = {}
    for name in drafters:
        records, _ = client.closed_loop(router_address, workload, list(range(len(workload))),
                                        sweep_speculation(name, depth), 1, max_new, bar)
        raw[name] = records
    return from_records(raw, depth, f"recorded from the local cluster: each drafter alone at depth {depth}, "
                                    f"{len(workload)} prompts, {max_new} new tokens"), raw
