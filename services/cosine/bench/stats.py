"""Pure arithmetic of `cosine bench`: per-request timings → per-system figures, ratios, the JSON shape.

No model, no gRPC, no clock: everything here is a function of recorded numbers, so
the unit tests (tests/unit/bench/) cover it exactly.

A request's record (`RequestRecord`): when it arrived (was due to be sent), when it
was sent, when each output token reached the client, its output token ids, and the
speculation counters (rounds, drafted, accepted) where the system reports them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cosine.client import target_passes

# Figures every JSON row carries (null where a figure does not apply to the system).
ROW_KEYS = (
    "name", "mode", "concurrency", "rate", "prompts", "tokens", "wall_s", "tokens_per_s",
    "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "tpot_ms_mean", "e2e_ms_p50", "e2e_ms_p99", "e2e_ms_mean",
    "mean_accepted_len", "acceptance_rate", "rounds", "drafted", "accepted",
    "verifier_busy", "drafter_busy", "identical_outputs",
    "ratio_to_target_only", "ratio_to_vanilla_sd", "tpot_ratio_to_vanilla_sd",
)


@dataclass
class RequestRecord:
    prompt_index: int  # index into the workload (the reference output is looked up by it)
    domain: str
    arrival_s: float  # when the request was due (Poisson) or sent (closed loop), on the run's clock
    token_times_s: list[float] = field(default_factory=list)  # when each output token reached the client
    token_ids: list[int] = field(default_factory=list)
    end_s: float | None = None  # when the request finished (the final message / generate() returned)
    rounds: int | None = None  # verification rounds (None: not reported, e.g. plain generate())
    drafted: int | None = None
    accepted: int | None = None
    drafters: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); None below 2 tokens."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    @property
    def e2e_s(self) -> float | None:
        end = self.end_s if self.end_s is not None else (self.token_times_s[-1] if self.token_times_s else None)
        return end - self.arrival_s if end is not None else None


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default);
    None for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def split_token_times(step_times: Sequence[tuple[float, int]], n_tokens: int) -> list[float]:
    """Per-token times of one sequence from a generate() step clock.

    `step_times`: (time, new tokens so far) after each step (a round of assisted generation may add
    several). Token i (0-based) is stamped with the first step whose count exceeds i."""
    times: list[float] = []
    for t, count in step_times:
        while len(times) < min(count, n_tokens):
            times.append(t)
    if len(times) < n_tokens and step_times:  # should not happen; stamp the rest with the last step
        times += [step_times[-1][0]] * (n_tokens - len(times))
    return times


def rounds_from_steps(step_times: Sequence[tuple[float, int]], n_tokens: int) -> int:
    """Steps (rounds) it took a sequence to reach its `n_tokens` outputs."""
    for i, (_, count) in enumerate(step_times):
        if count >= n_tokens:
            return i + 1
    return len(step_times)


def summarise(name: str, records: Sequence[RequestRecord], references: dict[int, list[int]] | None, *,
              mode: str = "closed", concurrency: int | None = 1, rate: float | None = None,
              wall_s: float | None = None, verifier_busy_s: float | None = None,
              drafter_busy_s: float | None = None) -> dict:
    """One system's figures at one load point.

    tokens_per_s: output tokens of all requests over the wall time from the first arrival to the last
    finish (or `wall_s` when given). mean_accepted_len: output tokens per verification step of a request
    (the accepted draft tokens + the target's own token), over all requests that report rounds; a decode
    run's plain steps count one each (`verification_steps`).
    acceptance_rate: accepted / drafted draft tokens. Busy fractions: busy seconds over the wall time
    (drafter_busy sums every drafter process, so it can exceed 1 with several drafters busy at once)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(len(r.token_ids) for r in ok)
    if wall_s is None:
        starts = [r.arrival_s for r in records]
        ends = [r.e2e_s + r.arrival_s for r in ok if r.e2e_s is not None]
        wall_s = (max(ends) - min(starts)) if ends and starts else None
    reported = [r for r in ok if r.rounds]
    rounds = sum(r.rounds for r in reported) if reported else None
    round_tokens = sum(len(r.token_ids) for r in reported)
    steps = sum(verification_steps(r) for r in reported)
    drafted = sum(r.drafted for r in ok if r.drafted is not None) if any(r.drafted is not None for r in ok) else None
    accepted = sum(r.accepted for r in ok if r.accepted is not None) if any(r.accepted is not None for r in ok) else None
    ttfts = [r.ttft_s for r in ok]
    tpots = [r.tpot_s for r in ok]
    e2es = [r.e2e_s for r in ok]
    identical = None
    if references is not None:
        identical = sum(1 for r in ok if references.get(r.prompt_index) == r.token_ids)
    row = {
        "name": name,
        "mode": mode,
        "concurrency": concurrency,
        "rate": rate,
        "prompts": len(records),
        "errors": len(records) - len(ok),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s else None,
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "tpot_ms_p50": _ms(percentile(tpots, 50)),
        "tpot_ms_p99": _ms(percentile(tpots, 99)),
        "tpot_ms_mean": _ms(mean(tpots)),
        "e2e_ms_p50": _ms(percentile(e2es, 50)),
        "e2e_ms_p99": _ms(percentile(e2es, 99)),
        "e2e_ms_mean": _ms(mean(e2es)),
        "mean_accepted_len": round_tokens / steps if rounds and steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "verifier_busy": verifier_busy_s / wall_s if verifier_busy_s is not None and wall_s else None,
        "drafter_busy": drafter_busy_s / wall_s if drafter_busy_s is not None and wall_s else None,
        "identical_outputs": identical,
        "accepted_len_by_domain": accepted_len_by_domain(ok),
        "drafters_used": sorted({d for r in ok for d in r.drafters}),
    }
    return row


def verification_steps(r: RequestRecord) -> int:
    """The target steps a request's output took: each step commits its accepted draft tokens and one token of
    the target's own, so output tokens − accepted ones (a decode run of k plain tokens is one round of k steps;
    without an accepted count, its rounds)."""
    if r.accepted is None:
        return r.rounds or 0
    return target_passes(len(r.token_ids), r.accepted)


def accepted_len_by_domain(records: Iterable[RequestRecord]) -> dict[str, float]:
    """Output tokens per verification step, per domain, over the requests that report rounds."""
    tokens: dict[str, int] = {}
    steps: dict[str, int] = {}
    for r in records:
        if r.rounds:
            tokens[r.domain] = tokens.get(r.domain, 0) + len(r.token_ids)
            steps[r.domain] = steps.get(r.domain, 0) + verification_steps(r)
    return {d: tokens[d] / steps[d] for d in sorted(tokens)}


def add_ratios(rows: list[dict], baseline: str = "target-only", vanilla: str = "vanilla-sd") -> list[dict]:
    """Ratios of tokens/s (and of mean TPOT for vanilla-sd) to the baselines at the same load point
    (same mode, concurrency and rate), in place; None where the baseline did not run at that point."""
    def key(row):
        return row["mode"], row["concurrency"], row["rate"]

    base = {key(r): r for r in rows if r["name"] == baseline}
    van = {key(r): r for r in rows if r["name"] == vanilla}
    for row in rows:
        b, v = base.get(key(row)), van.get(key(row))
        row["ratio_to_target_only"] = ratio(row["tokens_per_s"], b["tokens_per_s"]) if b else None
        row["ratio_to_vanilla_sd"] = ratio(row["tokens_per_s"], v["tokens_per_s"]) if v else None
        row["tpot_ratio_to_vanilla_sd"] = ratio(row["tpot_ms_mean"], v["tpot_ms_mean"]) if v else None
    return rows


def report(rows: list[dict], meta: dict) -> dict:
    """The JSON document: `systems` (one entry per system and load point, every ROW_KEYS key present)
    and everything else about the run under its own keys."""
    systems = []
    for row in rows:
        entry = {k: row.get(k) for k in ROW_KEYS}
        entry.update({k: v for k, v in row.items() if k not in entry})
        systems.append(entry)
    return {**meta, "systems": systems}


def check_report(doc: dict) -> list[str]:
    """What is wrong with a report's shape (empty: fine). Used by the tests and after writing."""
    problems = []
    if not isinstance(doc.get("systems"), list) or not doc["systems"]:
        return ["no `systems` list"]
    for i, entry in enumerate(doc["systems"]):
        missing = [k for k in ROW_KEYS if k not in entry]
        if missing:
            problems.append(f"systems[{i}] ({entry.get('name')}) lacks {missing}")
        for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "mean_accepted_len", "verifier_busy"):
            v = entry.get(k)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
                problems.append(f"systems[{i}].{k} is {v!r}, not a finite number or null")
    return problems


# --- arrival schedules ------------------------------------------------------------------------


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of `n` requests of a Poisson process of `rate` per second:
    exponential gaps drawn from random.Random(seed); the first request arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def request_order(n_prompts: int, n_requests: int) -> list[int]:
    """Prompt index of each request: the workload's prompts in order, cycled to fill `n_requests`."""
    if n_prompts <= 0:
        raise ValueError("the workload has no prompts")
    return [i % n_prompts for i in range(n_requests)]
