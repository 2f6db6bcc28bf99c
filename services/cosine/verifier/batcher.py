"""Continuous batching of verification rounds across requests (DESIGN §2, batch scheduling).

Each Verify stream hands its round to `VerifyBatcher.verify` and awaits the
outcome. One loop verifies waiting rounds together in one call of the engine's
`verify_batch` (`cosine.engine.target.TargetEngine`), so requests
arriving while a batch runs form the next batch instead of queueing one
forward each. Which waiting rounds go into a batch is the batch policy:

* ``fifo``: every waiting round, oldest first, up to ``max_batch``.
* ``objective``: `cosine.common.batching.choose_batch` over the waiting
  rounds — expected committed tokens plus waiting time minus the predicted
  step time, under a cap on verified positions, an optional KV-memory cap, an
  optional latency bound and ``max_batch``; rounds waiting past the deadline go
  first. The step time comes from a `VerifyTimeModel` fitted online from this
  batcher's own steps. A tree larger than the token cap could never be
  verified whole, so it counts as cut to the cap. Rounds the objective left
  out only because their tree broke the token cap then join while each still
  gets one position (and the other caps hold), and the batch's trees are
  shortened, longest first, to the cap (`shorten_longest_first`): a round's
  first position commits a token for sure, a tree's last draft token is its
  least likely. Rounds not chosen stay queued and age. A tree is cut to its
  first n nodes (topological order, so a tree again): verifying fewer draft
  tokens is still exact, it can only accept less.

**Decode runs.** A round with an empty tree may ask for ``steps`` > 1 tokens:
after the batch's step, its requests that asked for more go on with plain
steps, one after another on the model thread (each a `verify_batch` of
those requests with empty trees), and the round is answered once with all
its tokens. Each step is the same step a round of its own would be (the
same batch members, the same sampling positions), so the tokens are the
same; what goes is the round trip to the scheduler and its commit per token.
A request stops early when its context is full.

**Lookup.** A round with an empty tree may also allow ``lookup`` > 0: before each of its steps the request's
own tokens are looked up for a continuation of what it just wrote (`cosine.verifier.lookup.RunLookup`), and
the chain found is verified with the step, so a step may commit several tokens: a run of ``steps`` steps
gives at least that many tokens. (Every request of a run takes all its steps: the run lasts as long as its
longest request anyway, and a request that stopped early would only wait.) The target accepts only what
it would have written, so the tokens are the same; where the text repeats itself, a step commits more.
Looked-up positions stay within the batch's token cap, and never past a request's context.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cosine.common.streams import ModelWorker
from cosine.engine.sampling import Sampling
from cosine.engine.target import TargetEngine
from cosine.engine.tree import DraftTree, cut_tree
from cosine.verifier.lookup import RunLookup
from cosine.common.batching import (BatchLimits, Measurement, ReadyRequest, VerifyTimeModel, choose_batch, expected_committed,
                                    shorten_longest_first)

BatchPolicy = Literal["fifo", "objective"]


class Released(RuntimeError):
    """The request's cache was released before its round ran (its stream ended)."""


@dataclass
class _Pending:
    request_id: str
    tree: DraftTree
    sampling: Sampling
    future: asyncio.Future
    queued_at: float = 0.0
    steps: int = 1  # plain steps to decode (an empty tree only; see "Decode runs")
    lookup: int = 0  # most looked-up tokens verified with each plain step (an empty tree only; see "Lookup")


@dataclass(frozen=True)
class RoundOutcome:
    """A round's answer: what its steps committed."""

    token_ids: list[int]  # accepted draft tokens and the target's own, step after step
    accepted_draft: int  # of token_ids, from the round's draft tree
    lookup_drafted: int = 0  # tokens the verifier drafted itself (lookup and feature head) with the round's steps
    lookup_accepted: int = 0  # of token_ids, from those
    head_drafted: int = 0  # of lookup_drafted, the feature head's
    head_accepted: int = 0  # of lookup_accepted, the feature head's


@dataclass(frozen=True)
class BatchStep:
    """What one verification step did (reported to ``on_batch``)."""

    size: int  # rounds verified together
    seconds: float  # the step, model thread included
    verified_tokens: int  # Σ (1 + draft nodes kept): positions through the model
    deferred: int  # rounds left waiting for a later step
    trimmed: int  # trees cut to fit the token cap
    context_len: int  # the longest committed context in the batch
    draft_len: int  # the largest (kept) tree in the batch


class VerifyBatcher:
    def __init__(self, engine: TargetEngine, worker: ModelWorker, max_batch: int = 16,
                 on_batch: Callable[[BatchStep], None] | None = None, policy: BatchPolicy = "fifo",
                 limits: BatchLimits | None = None, time_model: VerifyTimeModel | None = None,
                 clock: Callable[[], float] = time.perf_counter, lookup: RunLookup | None = None):
        if policy not in ("fifo", "objective"):
            raise ValueError(f"batch policy must be 'fifo' or 'objective', got {policy!r}")
        self.engine = engine
        self.worker = worker
        self.max_batch = max_batch
        self.policy = policy
        limits = limits or BatchLimits()
        self.limits = replace(limits, max_requests=min(max_batch, limits.max_requests or max_batch))
        self.time_model = time_model or VerifyTimeModel()
        self.clock = clock
        self.lookup = lookup or RunLookup()
        self._on_batch = on_batch  # called with a BatchStep after each batch
        self._chain_only = not engine.verifies_trees  # the transformers backend verifies the main chain
        self._queue: list[_Pending] = []
        self.unanswered = 0  # rounds submitted and not yet answered (waiting or in the running step): reported as load
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def verify(self, request_id: str, tree: DraftTree, sampling: Sampling, steps: int = 1, lookup: int = 0):
        """(the round's `RoundOutcome`, the size of the batch it was verified in). ``steps`` > 1 (an empty tree
        only): that many plain steps, answered at once; ``lookup`` > 0 (an empty tree only): each step may verify
        up to that many looked-up tokens with it."""
        return await self.submit(request_id, tree, sampling, steps, lookup)

    def submit(self, request_id: str, tree: DraftTree, sampling: Sampling, steps: int = 1, lookup: int = 0) -> asyncio.Future:
        """Queue a round without waiting: rounds submitted before the caller next awaits are chosen from
        together (a scheduler's step arrives as one message). The future resolves like `verify`."""
        if steps > 1 and len(tree):
            raise ValueError("a round decodes several steps only without a draft tree")
        if lookup > 0 and len(tree):
            raise ValueError("a round looks tokens up only without a draft tree")
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        self.unanswered += 1
        future.add_done_callback(self._answered)
        self._queue.append(_Pending(request_id, tree, sampling, future, self.clock(), max(1, steps), max(0, lookup)))
        self._wakeup.set()
        return future

    def _answered(self, _future) -> None:
        self.unanswered -= 1

    # -- the choice (event-loop thread; no model calls) ----------------------------------

    def _context_len(self, request_id: str) -> int:
        try:
            return int(self.engine.context_len(request_id))
        except KeyError:  # released: its round is answered Released when the batch runs
            return 0

    def choose(self, queue: Sequence[_Pending]) -> tuple[list[_Pending], dict[int, int]]:
        """The next batch from ``queue`` (live rounds, oldest first): the rounds, in queue order, and
        ``{index in the batch: draft nodes to keep}`` for the trees to cut."""
        if self.policy == "fifo":
            return list(queue[: self.max_batch]), {}
        now = self.clock()
        limits = self.limits
        cap = limits.max_tokens
        per_token = int(self.engine.kv_bytes_per_token or 0)
        pool: list[ReadyRequest] = []
        for i, p in enumerate(queue):
            n = min(len(p.tree), cap - 1)  # a tree beyond the cap is never verified whole
            L = self._context_len(p.request_id)
            pool.append(ReadyRequest(f"{i:08d}", max(0.0, now - p.queued_at), L, n, per_token * (L + 1 + n),
                                     expected_committed(p.tree, n, self._chain_only)))
        choice = choose_batch(pool, self.time_model, limits)
        chosen = [int(key) for key in choice.request_ids]
        drafts = {i: choice.trim.get(pool[i].request_id, pool[i].draft_tokens) for i in chosen}
        # Rounds left out only because their whole tree broke the token cap join, oldest first, while every
        # round keeps at least its one position and the other caps hold; then the longest trees are
        # shortened first down to the cap (DESIGN §2): one more round's bonus token is worth more than the
        # least likely draft tokens of the others.
        tokens = sum(1 + d for d in drafts.values())
        memory = sum(pool[i].kv_bytes for i in chosen)
        for r in pool:
            i = int(r.request_id)
            if i in drafts or tokens + r.verify_tokens <= cap:
                continue  # chosen, or left out by the objective or another cap, not by the token cap
            if len(drafts) >= (limits.max_requests or len(pool)) or len(drafts) + 1 > cap:
                break
            if limits.max_memory is not None and memory + r.kv_bytes > limits.max_memory:
                continue
            members = [pool[j] for j in drafts] + [r]  # (whole trees: a bound the shortening can only help)
            if limits.max_step_s is not None and self.time_model.predict(
                    len(members), max(m.context_len for m in members), max(m.draft_tokens for m in members)) > limits.max_step_s:
                continue
            drafts[i] = r.draft_tokens
            tokens += r.verify_tokens
            memory += r.kv_bytes
        if sum(1 + d for d in drafts.values()) > cap:
            drafts = shorten_longest_first(drafts, max(0, cap - len(drafts)))
        order = sorted(drafts)
        batch = [queue[i] for i in order]
        trims = {j: drafts[i] for j, i in enumerate(order) if drafts[i] < len(queue[i].tree)}
        return batch, trims

    # -- the loop ---------------------------------------------------------------------

    def _verify_present(self, batch: list[tuple[str, DraftTree, Sampling]], steps: Sequence[int] = (),
                        lookups: Sequence[int] = ()) -> tuple[dict[str, RoundOutcome], list[tuple[int, int, int, float]]]:
        """On the model thread: verify the rounds whose request still holds a cache, then the decode runs'
        further plain steps (`steps[i]`: steps the i-th round asks for), each plain step with what the lookup
        finds where the round allows it (`lookups[i]`). Returns the outcomes by request id and, for every step,
        (rows, positions, largest draft, seconds)."""
        steps = list(steps) or [1] * len(batch)
        lookups = list(lookups) or [0] * len(batch)
        live = [(item, n, k) for item, n, k in zip(batch, steps, lookups) if item[0] in self.engine]
        if any(k > 0 for _, _, k in live):
            self.lookup.forget(self.engine.__contains__)
        merged: dict[str, RoundOutcome] = {}
        left = {item[0]: n for item, n, _ in live}
        limit = self.engine.max_context if any(n > 1 or k > 0 for _, n, k in live) else 0  # read only where needed
        record: list[tuple[int, int, int, float]] = []
        while live:
            room = self.limits.max_tokens - sum(1 + len(tree) for (_, tree, _), _, _ in live)
            asks, at = [], []
            for j, ((rid, tree, _), _, k) in enumerate(live):
                if k > 0 and not len(tree):
                    committed = self.engine.committed(rid)
                    depth = min(k, room, limit - len(committed) - 1)
                    if depth > 0:
                        asks.append((rid, committed, depth, self.engine.hidden(rid)))
                        at.append(j)
            found = dict(zip(at, self.lookup.chains(asks, len(live)))) if asks else {}
            items, looked = [], []
            for j, ((rid, tree, sampling), _, k) in enumerate(live):
                source = ""
                if j in found and room > 0:
                    tree, source = found[j]
                    tree = cut_tree(tree, room)  # the batch's token cap, in request order
                    room -= len(tree)
                looked.append((len(tree), source))
                items.append((rid, tree, sampling))
            started = time.perf_counter()
            outcomes = self.engine.verify_batch(items)
            record.append((len(items), sum(1 + len(t) for _, t, _ in items), max(len(t) for _, t, _ in items),
                           time.perf_counter() - started))
            for (rid, _, _), o, (n, source) in zip(items, outcomes, looked):
                done = merged.get(rid) or RoundOutcome([], 0)
                accepted = o.accepted_draft if source else 0  # from the verifier's own chain
                head = source == "head"
                merged[rid] = RoundOutcome(done.token_ids + list(o.token_ids), done.accepted_draft + o.accepted_draft - accepted,
                                           done.lookup_drafted + n, done.lookup_accepted + accepted,
                                           done.head_drafted + (n if head else 0), done.head_accepted + (accepted if head else 0))
                left[rid] -= 1
            live = [((rid, DraftTree(), sampling), n, k) for (rid, _, sampling), n, k in live
                    if left[rid] > 0 and self.engine.context_len(rid) < limit]
        return merged, record

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while True:
                self._queue = [p for p in self._queue if not p.future.done()]
                if not self._queue:
                    break
                batch, trims = self.choose(self._queue)
                taken = {id(p) for p in batch}
                self._queue = [p for p in self._queue if id(p) not in taken]
                deferred = len(self._queue)  # waiting now, not what arrives during the step
                trees = [cut_tree(p.tree, trims[j]) if j in trims else p.tree for j, p in enumerate(batch)]
                items = [(p.request_id, tree, p.sampling) for p, tree in zip(batch, trees)]
                context_len = max(self._context_len(p.request_id) for p in batch)
                draft_len = max(len(t) for t in trees)
                steps = [p.steps for p in batch]
                lookups = [p.lookup for p in batch]
                started = time.perf_counter()
                try:
                    outcomes, record = await self.worker.run(self._verify_present, items, steps, lookups)
                except Exception as exc:  # noqa: BLE001 - every round of the batch learns of it
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                runs = record[1:]  # a decode run's further steps
                seconds = time.perf_counter() - started - sum(r[-1] for r in runs)  # the first step's
                positions = sum(1 + len(t) for t in trees)
                if record:  # as verified: the lookup may have lengthened the empty trees
                    positions, draft_len = record[0][1], max(draft_len, record[0][2])
                if outcomes:
                    self.time_model.add(Measurement(len(outcomes), context_len, draft_len, seconds))
                if self._on_batch is not None:
                    self._on_batch(BatchStep(len(batch), seconds, positions, deferred, len(trims), context_len, draft_len))
                for rows, run_positions, run_draft, run_s in runs:  # as the steps they are
                    self.time_model.add(Measurement(rows, context_len, run_draft, run_s))
                    if self._on_batch is not None:
                        self._on_batch(BatchStep(rows, run_s, run_positions, 0, 0, context_len, run_draft))
                for p in batch:
                    if p.future.done():
                        continue
                    outcome = outcomes.get(p.request_id)
                    if outcome is None:
                        p.future.set_exception(Released(f"request {p.request_id} was released"))
                    else:
                        p.future.set_result((outcome, len(outcomes)))

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
