"""Batch scheduling (DESIGN §2): which ready requests the verifier checks next, and how long steps take.

**Time models.** `VerifyTimeModel` and `DraftTimeModel` are linear in a few
features of (batch size b, longest context L, draft length d) and are fitted by
ordinary least squares (numpy, already installed with torch/transformers) from
`Measurement`s the services report:

* verify: ``t = c0 + c1·b·(d+1) + c2·b·L + c3·b·(d+1)·L`` — a fixed cost (weights
  are read once per step), the tokens pushed through the layers, the KV cache
  read, and attention of the new tokens over the context. The batch is padded,
  so d is the largest tree in it.
* draft (one drafter, a round of d steps): ``t = c0 + c1·d + c2·d·b + c3·d·b·L``
  — a per-round overhead and, per step, a fixed cost, the batch's tokens and its
  KV read. A fusion step waits for every participating drafter, so
  `draft_round_time` is the slowest drafter's prediction.

Until a model has as many linearly independent measurements as coefficients it
predicts with the coefficients it was built with. Predictions are never < 0.

**Batch choice.** `choose_batch` picks a subset B of the ready pool that
*maximises the utility* ::

    U(B) = Σ_{r∈B} (w_tokens · g_r + w_wait · wait_r) − w_time · T_v(B)

equivalently minimises the weighted sum ``w_time·T_v(B) − Σ (w_tokens·g_r +
w_wait·wait_r)``: ``T_v(B)`` is added to the latency of every request in the
pool; ``g_r`` (expected committed tokens: accepted drafts + bonus) is what
verification produces; ``wait_r`` is the time the request has been ready, which
ages requests so none starves. Subject to

* Σ_{r∈B} (1 + draft_tokens_r) ≤ ``max_tokens`` (verified positions per step:
  the tree plus the position after the committed prefix);
* Σ kv_bytes_r ≤ ``max_memory``;
* ``len(B) ≤ max_requests`` (the verifier's ``max_batch``);
* ``T_v(B) ≤ max_step_s`` (the latency bound of one verification step, i.e. on
  time per output token of everyone in the pool);
* requests that have waited ``≥ deadline_s`` are taken first, oldest first,
  whenever they fit.

Greedy by marginal utility (deterministic: ties → longer wait, then request
id); the first pick is always made if it fits the memory cap, so the verifier
never idles while work is ready. A request whose tree alone exceeds the token
cap is taken, when nothing else can be, with its draft trimmed to fit
(`BatchChoice.trim`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from cosine.engine.tree import DraftTree

_UNKNOWN_PROB = 0.5  # a node without a drafter probability counts as a coin flip


@dataclass(frozen=True)
class Measurement:
    """One timed step: batch size, longest context, draft length (tree size / steps), seconds."""

    batch_size: int
    context_len: int
    draft_len: int
    seconds: float


class LinearTimeModel:
    """Least-squares time model over `features`, fitted on a window of recent measurements.

    A model is asked for predictions many times per step (the batch choice tries every candidate), so
    `predict` refits lazily, and once the window holds many measurements only after every 1/32 of it is
    new (every 16 steps with the default window): one more step barely moves a fit over hundreds, and a
    refit per step cost the scheduler and the verifier a quarter of their CPU at one request in flight.
    `fit()` refits at once. Each measurement's features are computed once, when it is added.
    """

    n_features = 0

    def __init__(self, coef: Sequence[float] | None = None, window: int = 512):
        if coef is None:
            coef = [0.0] * self.n_features
        if len(coef) != self.n_features:
            raise ValueError(f"{type(self).__name__} has {self.n_features} coefficients, got {len(coef)}")
        self.coef = np.asarray(coef, dtype=float)
        self.samples: deque[Measurement] = deque(maxlen=window)
        self._rows: deque[list[float]] = deque(maxlen=window)  # features of each sample, in step
        self._new = 0  # measurements added since the last fit

    @staticmethod
    def features(b: int, L: int, d: int) -> list[float]:
        raise NotImplementedError

    def add(self, m: Measurement) -> None:
        if m.seconds < 0 or m.batch_size < 0 or m.context_len < 0 or m.draft_len < 0:
            raise ValueError(f"measurement has a negative field: {m}")
        self.samples.append(m)
        self._rows.append(self.features(m.batch_size, m.context_len, m.draft_len))
        self._new += 1

    def fit(self, samples: Iterable[Measurement] = ()) -> np.ndarray:
        """Add ``samples``, refit on the window; returns the coefficients (unchanged while under-determined)."""
        for m in samples:
            self.add(m)
        self._new = 0
        if len(self.samples) < self.n_features:
            return self.coef
        X = np.array(self._rows)
        y = np.array([m.seconds for m in self.samples])
        # lstsq's rank uses matrix_rank's cut-off (largest singular value x max(M, N) x eps)
        coef, _, rank, _ = np.linalg.lstsq(X, y, rcond=None)
        if rank >= self.n_features:
            self.coef = coef
        return self.coef

    def predict(self, b: int, L: int, d: int) -> float:
        if self._new and self._new >= len(self.samples) >> 5:
            self.fit()
        return max(0.0, float(np.dot(self.coef, self.features(b, L, d))))


class VerifyTimeModel(LinearTimeModel):
    """Verifier step time: ``c0 + c1·b(d+1) + c2·bL + c3·b(d+1)L`` (d: the largest tree in the batch)."""

    n_features = 4

    @staticmethod
    def features(b: int, L: int, d: int) -> list[float]:
        n = b * (d + 1)
        return [1.0, float(n), float(b * L), float(n * L)]


class DraftTimeModel(LinearTimeModel):
    """One drafter's time for a round of d steps over b requests: ``c0 + c1·d + c2·db + c3·dbL``."""

    n_features = 4

    @staticmethod
    def features(b: int, L: int, d: int) -> list[float]:
        return [1.0, float(d), float(d * b), float(d * b * L)]


def draft_round_time(models: Mapping[str, DraftTimeModel], load: Mapping[str, tuple[int, int, int]]) -> float:
    """Time of a drafting round: the slowest participating drafter (``load[name] = (b, L, d)``)."""
    return max((models[name].predict(*bld) for name, bld in load.items()), default=0.0)


@dataclass(frozen=True)
class ReadyRequest:
    """A request whose draft tree is ready for verification."""

    request_id: str
    waiting_s: float  # since its tree became ready
    context_len: int  # committed tokens
    draft_tokens: int  # nodes in its tree
    kv_bytes: int = 0  # KV memory the verifier needs for it this step
    expected_tokens: float = 1.0  # tokens it is expected to commit (accepted + bonus)

    @property
    def verify_tokens(self) -> int:
        return 1 + self.draft_tokens


@dataclass(frozen=True)
class BatchLimits:
    """Caps and weights of the batch choice (see the module docstring)."""

    max_tokens: int = 512
    max_memory: int | None = None
    max_requests: int | None = None
    max_step_s: float | None = None
    deadline_s: float | None = None
    w_tokens: float = 1.0
    w_wait: float = 1.0
    w_time: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be at least 1 or None, got {self.max_requests}")
        for name in ("max_memory", "max_step_s", "deadline_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if min(self.w_tokens, self.w_wait, self.w_time) < 0:
            raise ValueError("weights must be >= 0")


@dataclass
class BatchChoice:
    """The chosen batch, in choice order, with its predicted step time and utility."""

    request_ids: list[str] = field(default_factory=list)
    step_s: float = 0.0
    utility: float = 0.0
    tokens: int = 0  # verified positions, trims applied
    memory: int = 0
    trim: dict[str, int] = field(default_factory=dict)  # request id → draft tokens it may keep


def _step_time(model: VerifyTimeModel, batch: Sequence[ReadyRequest], trim: Mapping[str, int]) -> float:
    if not batch:
        return 0.0
    d = max(trim.get(r.request_id, r.draft_tokens) for r in batch)
    return model.predict(len(batch), max(r.context_len for r in batch), d)


def choose_batch(pool: Sequence[ReadyRequest], model: VerifyTimeModel, limits: BatchLimits) -> BatchChoice:
    """The next verification batch (see the module docstring for the objective and caps)."""
    ids = [r.request_id for r in pool]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids in the pool must be unique")
    value = {r.request_id: limits.w_tokens * r.expected_tokens + limits.w_wait * r.waiting_s for r in pool}
    batch: list[ReadyRequest] = []
    tokens = memory = 0
    longest = largest = 0  # the batch's longest context and largest tree
    base_time = 0.0

    def fits(r: ReadyRequest) -> float | None:
        """Step time with r added, or None if r breaks a cap."""
        if limits.max_requests is not None and len(batch) >= limits.max_requests:
            return None
        if tokens + r.verify_tokens > limits.max_tokens:
            return None
        if limits.max_memory is not None and memory + r.kv_bytes > limits.max_memory:
            return None
        # the batch's padding only grows: its longest context and largest tree so far, or r's
        t = model.predict(len(batch) + 1, max(longest, r.context_len), max(largest, r.draft_tokens))
        if batch and limits.max_step_s is not None and t > limits.max_step_s:
            return None
        return t

    def add(r: ReadyRequest, t: float) -> None:
        nonlocal tokens, memory, base_time, longest, largest
        batch.append(r)
        tokens += r.verify_tokens
        memory += r.kv_bytes
        base_time = t
        longest, largest = max(longest, r.context_len), max(largest, r.draft_tokens)

    remaining = sorted(pool, key=lambda r: (-r.waiting_s, r.request_id))
    if limits.deadline_s is not None:  # overdue first, oldest first
        for r in [r for r in remaining if r.waiting_s >= limits.deadline_s]:
            t = fits(r)
            if t is not None:
                add(r, t)
                remaining.remove(r)
    while remaining:
        best = None
        for r in remaining:  # already ordered by (longer wait, id): strict > keeps the tie-break
            t = fits(r)
            if t is None:
                continue
            gain = value[r.request_id] - limits.w_time * (t - base_time)
            if best is None or gain > best[0]:
                best = (gain, r, t)
        if best is None or (batch and best[0] <= 0):
            break
        add(best[1], best[2])
        remaining.remove(best[1])

    choice = BatchChoice(trim={})
    if not batch and pool:  # nothing fits whole: the oldest request that fits the memory cap, trimmed
        for r in remaining:
            if limits.max_memory is None or r.kv_bytes <= limits.max_memory:
                keep = min(r.draft_tokens, limits.max_tokens - 1)
                batch, choice.trim = [r], {r.request_id: keep}
                tokens, memory = 1 + keep, r.kv_bytes
                break
    choice.request_ids = [r.request_id for r in batch]
    choice.step_s = _step_time(model, batch, choice.trim)
    choice.tokens, choice.memory = tokens, memory
    choice.utility = sum(value[r.request_id] for r in batch) - limits.w_time * choice.step_s
    return choice


def expected_committed(tree: DraftTree, n: int | None = None, chain_only: bool = False) -> float:
    """Tokens a round is expected to commit: 1 (the target's own) + expected accepted drafts.

    With the drafters' probabilities read as the chance that the target agrees
    with each node given its parent, a node is accepted with the product of the
    probabilities on its path; siblings exclude each other, so the expected
    accepted length is the sum of that over the (first n) nodes. ``chain_only``:
    the main chain alone (engines that verify only the chain).
    """
    n = len(tree) if n is None else min(n, len(tree))
    keep = set(tree.main_chain()) if chain_only else None
    path_prob: list[float] = []
    total = 0.0
    for i in range(n):
        p = tree.probs[i] if i < len(tree.probs) else _UNKNOWN_PROB
        p = min(1.0, max(0.0, float(p)))
        parent = tree.parents[i]
        path_prob.append(p * (path_prob[parent] if parent >= 0 else 1.0))
        if keep is None or i in keep:
            total += path_prob[i]
    return 1.0 + total


def shorten_longest_first(depths: Mapping[str, int], cap: int, floor: int = 0) -> dict[str, int]:
    """Cut speculation until Σ depths ≤ cap, one token at a time from the longest (never below ``floor``).

    Ties: the later key in ``depths`` order loses first. If even all-``floor``
    exceeds the cap, returns all-``floor`` (the caller must split the batch).
    """
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    out = dict(depths)
    excess = sum(out.values()) - cap
    if excess <= 0:
        return out
    order = {k: i for i, k in enumerate(out)}
    heap = [(-d, -order[k], k) for k, d in out.items() if d > floor]
    heapq.heapify(heap)
    while excess > 0 and heap:
        neg_d, neg_i, k = heapq.heappop(heap)
        out[k] = -neg_d - 1
        excess -= 1
        if out[k] > floor:
            heapq.heappush(heap, (-out[k], neg_i, k))
    return out
