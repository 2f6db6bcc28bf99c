"""The scheduler's step loop (DESIGN §2, batch scheduling and pipelining), as pure code.

One loop runs the rounds of *all* the scheduler's live requests. A request is
idle (its next round not started), drafting, ready (its draft tree is in hand,
or it does not speculate this round), verifying, or ended. Each turn of the
loop:

1. launches a draft for every idle request at once (a request drafting at
   depth 0, with speculation off or adaptive depth at 0, is ready at once);
2. when no verification is in flight, picks the next step's batch from the
   ready requests with `choose_batch` (its caps: the verifier's batch size and
   verified positions), and decides whether waiting for drafts still in flight
   pays (`drafts_to_wait_for`): waiting delays every ready request, not
   waiting costs the drafting ones a whole later step;
3. sends the whole batch to the verifier at once (one call of the verify port),
   with the opens of requests new to the verifier and the releases of ended
   ones;
4. when the verdicts come back, cuts each round at its end conditions, commits
   the step's rounds at once (one call of the commit port), streams each
   request's tokens, and launches the next drafts right away.

**Decode runs.** A step whose every round decodes plainly (no draft tree, no
request opening) asks the verifier for up to ``decode_steps`` tokens of each
round at once (`Request.steps`; never past a request's length or context, and
no more steps than fit in ``decode_run_s`` by the recent step time): the
verifier runs the steps back to back and answers once, so a round trip, a
commit and a stream message are paid per run instead of per token. The tokens
are the ones single steps would give (sampling is seeded by position). A
run ends where the first of its requests ends; a request arriving meanwhile
waits for the run's end, at most ``decode_run_s``.

**Lanes.** A request stays on the verifier it was opened on (its KV cache lives there):
``Request.lane`` names that verifier (the adapter sets it; None when there is one). Each lane
has its own steps — one in flight per lane at a time, batches formed from that lane's
requests, releases sent on it — so several verifiers verify at once.

So with two groups of requests, the drafters draft group B while the verifier
checks group A, and the other way round (the paper's pipelining, at any
concurrency); with speculation off every live request joins every step. With
one request in flight the adapter may also draft *ahead* of its verification
(`cosine.scheduler.ahead`).

The loop has no gRPC or Redis inside: everything outside it goes through
`StepPorts` (the service implements them over its streams and Redis) and the
clock (`Clock`), so tests drive it with fakes and virtual time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cosine.common.v1 import common_pb2
from cosine.engine.tree import DraftTree
from cosine.scheduler import policy
from cosine.scheduler.ahead import subtree_after
from cosine.common.batching import BatchLimits, Measurement, ReadyRequest, VerifyTimeModel, choose_batch, expected_committed

log = logging.getLogger(__name__)

IDLE, DRAFTING, READY, VERIFYING, ENDED = "idle", "drafting", "ready", "verifying", "ended"


@dataclass
class RoundOrder:
    """What one round drafts: depth 0 means no drafting (plain decoding of one token)."""

    depth: int
    drafters: list[str] = field(default_factory=list)
    budget: int = 0  # most tree nodes; 0: the drafters' default
    committed: list[int] = field(default_factory=list)  # tokens committed since the request's previous draft
    context: list[int] = field(default_factory=list)  # speculative tokens after the committed ones (drafting ahead)


@dataclass
class Draft:
    tree: DraftTree
    drafters: list[str] = field(default_factory=list)
    compute_s: float = 0.0  # drafting time as the drafters measured it
    payload: Any = None  # the adapter's (what routing learns from)


@dataclass
class Verdict:
    token_ids: list[int]  # accepted draft tokens + the target's own next token
    accepted_draft: int  # of token_ids, from the round's tree
    compute_s: float = 0.0  # as the verifier measured it
    lookup_drafted: int = 0  # tokens the verifier looked up and verified with the round's plain steps
    lookup_accepted: int = 0  # of token_ids, from its lookup


@dataclass
class Emission:
    """What a request's stream receives: the tokens of one round, then once a final (or an error)."""

    token_ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED  # set: the request's last round
    error: BaseException | None = None


@dataclass
class RoundRecord:
    """One finished round, for the adapter's learning and metrics (seconds on the loop's clock)."""

    order: RoundOrder
    draft: Draft | None
    tree: DraftTree  # the tree verified (the draft's, trimmed to the step's caps)
    verdict: Verdict
    committed: list[int]
    draft_s: float  # the draft's wall time (0 without one)
    verify_s: float  # the step's wall time
    commit_s: float
    round_s: float  # from the round's start to its commit
    batch_size: int
    steps: int = 1  # plain steps the round decoded (a decode run; 1 otherwise)


@dataclass
class Request:
    """A live request as the loop sees it; ``payload`` is the adapter's own (its plan, streams, spans)."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    max_context: int
    stop_token_ids: frozenset[int] = frozenset()
    payload: Any = None
    lane: Any = None  # the verifier the request is opened on (its steps go there; see the module's notes)
    # loop state
    state: str = IDLE
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # committed tokens the drafters have not seen yet
    step: int = 0  # the commit fence
    steps: int = 1  # plain steps of the round being verified (a decode run; 1 otherwise)
    lookup: int = 0  # most tokens the verifier may look up and verify with each of its plain steps (the adapter's)
    lookup_drafted: int = 0  # tokens the verifier looked up for it (not in drafted)
    lookup_accepted: int = 0  # of those, accepted (not in accepted)
    opened: bool = False  # the verifier holds it
    order: RoundOrder | None = None
    draft: Draft | None = None
    task: asyncio.Task | None = None
    round_started: float = 0.0
    draft_started: float = 0.0
    draft_s: float = 0.0
    ready_at: float = 0.0
    ahead: tuple[asyncio.Task, list[int], RoundOrder] | None = None
    draft_estimate: float | None = None  # EWMA of this request's draft wall times
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafters_used: list[str] = field(default_factory=list)

    @property
    def context_used(self) -> int:
        return self.prompt_len + len(self.generated)

    def room(self, extra: int = 0, max_depth: int = 1 << 30) -> int:
        """Most draft tokens the next round may verify (`extra`: tokens assumed committed before it)."""
        return policy.round_depth(max_depth, len(self.generated) + extra, self.max_new_tokens, self.context_used + extra,
                                  self.max_context)


class StepPorts(Protocol):
    """Everything outside the loop (the scheduler service implements these over gRPC and Redis)."""

    def plan_round(self, request: Request, room: int) -> RoundOrder:
        """Depth (≤ room), drafters and budget of the request's next round; depth 0: no drafting."""

    def plan_ahead(self, request: Request, order: RoundOrder, tree: DraftTree, room: int, live: int) -> RoundOrder | None:
        """A round to draft during this one's verification (None: not now)."""

    async def draft(self, request: Request, order: RoundOrder) -> Draft: ...

    async def verify(self, rounds: Sequence[tuple[Request, DraftTree]], opens: Sequence[Request],
                     releases: Sequence[str]) -> list[Verdict | BaseException]:
        """Verify the rounds in one step (opening ``opens`` first, releasing ``releases``): one result per round."""

    async def commit(self, rounds: Sequence[tuple[Request, list[int], int, int]]) -> list[BaseException | None]:
        """Commit (request, tokens, drafted, accepted) of one step at once; one result per round (None: done)."""

    def emit(self, request: Request, emission: Emission) -> None: ...

    def learn(self, request: Request, record: RoundRecord) -> None: ...

    def observe_ahead(self, request: Request, draft: Draft | None, order: RoundOrder, used: bool) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def drafts_to_wait_for(ready: int, remaining: Sequence[float], step_s: Callable[[int], float]) -> int:
    """How many of the drafts in flight (``remaining``: predicted seconds until each is ready, ascending) the
    next step should wait for; 0: verify the ``ready`` requests now.

    Minimises the requests' summed completion times over this step and the next: waiting for the first k
    drafts (the k soonest) delays the n = ready + k requests of the step by ``remaining[k-1]``; the drafts not
    waited for are verified together in the following step. ``step_s(n)``: predicted step time for n requests.
    """
    if ready <= 0 and not remaining:
        return 0
    best_k, best_cost = 0, None
    for k in range(0, len(remaining) + 1):
        if ready + k == 0:
            continue
        wait = remaining[k - 1] if k else 0.0
        done = wait + step_s(ready + k)
        rest = remaining[k:]
        cost = (ready + k) * done
        if rest:
            cost += len(rest) * (max(done, rest[-1]) + step_s(len(rest)))
        if best_cost is None or cost < best_cost - 1e-12:
            best_k, best_cost = k, cost
    return best_k


class StepLoop:
    """Runs every live request's rounds as steps over the ports (see the module docstring)."""

    def __init__(self, ports: StepPorts, limits: BatchLimits | None = None, clock: Clock | None = None,
                 max_depth: int = 16, time_model: VerifyTimeModel | None = None, smoothing: float = 0.3,
                 on_step: Callable[[int, float], None] | None = None, decode_steps: int = 1,
                 decode_run_s: float = 0.1):
        self.ports = ports
        self.limits = limits or BatchLimits()
        self.clock = clock or MonotonicClock()
        self.max_depth = max_depth
        self.time_model = time_model or VerifyTimeModel()
        self.smoothing = smoothing
        self.on_step = on_step  # (batch size, seconds) after each verification step
        self.decode_steps = max(1, decode_steps)  # most tokens of a decode run (see the module's notes)
        self.decode_run_s = decode_run_s  # a decode run's steps fit in this, by the recent step time
        self.requests: dict[str, Request] = {}
        self._releases: dict[Any, list[str]] = {}  # lane -> request ids to release on it
        self._wake = asyncio.Event()
        self._steps: dict[Any, tuple[asyncio.Task, list[tuple[Request, DraftTree]], float]] = {}  # lane -> step in flight
        self._step_estimate: float | None = None  # EWMA of step wall times
        self._draft_estimate: float | None = None  # EWMA of all draft wall times
        self._task: asyncio.Task | None = None
        self.steps: list[list[str]] = []  # request ids of each step (tests and diagnostics read it)

    # -- the adapter's side ----------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id} is in the loop already")
        request.state = IDLE
        self.requests[request.request_id] = request
        self._ensure_running()
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """The request's stream went away: end it (its verifier cache is released with the next step)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._end(request)
            self._wake.set()

    @property
    def live(self) -> int:
        return len(self.requests)

    @property
    def step_estimate(self) -> float | None:
        """Recent mean wall time of a step (None before the first)."""
        return self._step_estimate

    @property
    def quiet(self) -> bool:
        """No step in flight and no release waiting to be sent (a drain waits for this before handing over)."""
        return not self._steps and not any(self._releases.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for request in list(self.requests.values()):
            self._end(request)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    # -- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                timeout = await self._turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a port broke its contract: fail what is live, keep serving
                log.exception("step loop: failing %d live requests", len(self.requests))
                for task, *_ in self._steps.values():
                    task.cancel()
                self._steps.clear()
                for request in list(self.requests.values()):
                    self._fail(request, exc)
                timeout = None
            await self._wait(timeout)

    async def _turn(self) -> float | None:
        """One turn of the loop; returns how long to wait for the next event at most (None: no limit)."""
        for lane in [lane for lane, (task, *_) in self._steps.items() if task.done()]:
            await self._finish_step(lane)
        self._launch()
        timeout = None
        for lane in dict.fromkeys(r.lane for r in self.requests.values() if r.state == READY):
            if lane not in self._steps:
                wait = self._maybe_step(lane)
                if wait is not None:
                    timeout = wait if timeout is None else min(timeout, wait)
        for lane in [lane for lane, rids in self._releases.items() if rids]:
            if lane not in self._steps and not any(r.state == VERIFYING and r.lane == lane for r in self.requests.values()):
                self._start_step(lane, [], [])  # nothing to verify there: the releases go on their own
        return timeout

    async def _wait(self, timeout: float | None) -> None:
        if self._wake.is_set():
            self._wake.clear()
            return
        waiter = asyncio.ensure_future(self._wake.wait())
        waits = {waiter}
        if timeout is not None:
            waits.add(asyncio.ensure_future(self.clock.sleep(max(timeout, 0.0))))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._wake.clear()

    def _launch(self) -> None:
        """Start the next round of every idle request: a draft, or ready at once without one."""
        now = self.clock.now()
        for request in list(self.requests.values()):
            if request.state != IDLE:
                continue
            request.round_started = now
            room = request.room(max_depth=self.max_depth)
            try:
                order = self.ports.plan_round(request, room)
            except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
                self._fail(request, exc)
                continue
            order.depth = min(order.depth, room)
            request.order = order
            if order.depth <= 0:
                self._ready(request, None, now)
                continue
            order.committed, request.unsent = request.unsent, []
            request.state = DRAFTING
            request.draft_started = now
            request.task = self._spawn(self.ports.draft(request, order), request)

    def _spawn(self, coro, request: Request, timed: bool = True) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(lambda t, r=request: self._drafted(r, t, timed))
        return task

    def _drafted(self, request: Request, task: asyncio.Task, timed: bool) -> None:
        """A draft finished (on the event loop, as a task callback); `timed`: its wall time was a whole draft."""
        if request.task is not task or request.state != DRAFTING:
            return  # ended meanwhile
        request.task = None
        if task.cancelled():
            return
        exc = task.exception()
        draft = None if exc is not None else task.result()
        if exc is not None:
            self._fail(request, exc)
        elif draft is None:  # drafted ahead, and the verdict went otherwise: draft the round afresh
            request.state = IDLE
        else:
            now = self.clock.now()
            if timed:
                self._observe_draft(request, now - request.draft_started)
            self._ready(request, draft, now)
        self._wake.set()

    def _observe_draft(self, request: Request, seconds: float) -> None:
        a = self.smoothing
        request.draft_s = seconds
        request.draft_estimate = seconds if request.draft_estimate is None else (1 - a) * request.draft_estimate + a * seconds
        self._draft_estimate = seconds if self._draft_estimate is None else (1 - a) * self._draft_estimate + a * seconds

    def _ready(self, request: Request, draft: Draft | None, now: float) -> None:
        request.draft = draft
        request.state = READY
        request.ready_at = now

    # -- choosing and running a step -------------------------------------------------

    def predict_step(self, n: int, context_len: int = 0, draft_len: int = 0) -> float:
        """Predicted seconds of a step of n requests: the fitted model once it has data, else the recent mean."""
        if len(self.time_model.samples) >= 8:
            t = self.time_model.predict(n, context_len, draft_len)
            if t > 0:
                return t
        return self._step_estimate or 0.0

    def _remaining(self, request: Request, now: float) -> float:
        """Predicted seconds until the request's draft is ready; a draft past its prediction is assumed to
        need as long again as it has run (so waiting for a stuck drafter stops paying)."""
        elapsed = now - request.draft_started
        estimate = request.draft_estimate if request.draft_estimate is not None else self._draft_estimate
        if estimate is not None and elapsed < estimate:
            return estimate - elapsed
        return elapsed

    def _maybe_step(self, lane: Any = None) -> float | None:
        """Start a step on the lane if it pays now; else the seconds after which to look again (None: on the next event)."""
        now = self.clock.now()
        on_lane = [r for r in self.requests.values() if r.lane == lane]
        ready = [r for r in on_lane if r.state == READY]
        if not ready:
            return None
        pool = []
        for r in ready:
            tree = r.draft.tree if r.draft is not None else DraftTree()
            pool.append(ReadyRequest(r.request_id, max(0.0, now - r.ready_at), r.context_used, len(tree),
                                     expected_tokens=expected_committed(tree)))
        choice = choose_batch(pool, self.time_model, self.limits)
        chosen = [self.requests[rid] for rid in choice.request_ids]
        drafting = sorted((self._remaining(r, now), r.request_id) for r in on_lane if r.state == DRAFTING)
        room = (self.limits.max_requests or len(on_lane)) - len(chosen)
        if drafting and room > 0 and self._step_estimate is not None:
            longest = max(r.context_used for r in on_lane)
            largest = max([len(r.draft.tree) for r in chosen if r.draft is not None] + [0])
            remaining = [s for s, _ in drafting[:room]]
            k = drafts_to_wait_for(len(chosen), remaining, lambda n: self.predict_step(n, longest, largest))
            if k > 0:
                wait = remaining[k - 1]
                # look again when the waited-for draft should be in (or after a slice of a step, if late)
                return max(wait, 0.05 * self._step_estimate, 1e-4)
        rounds = []
        for r in chosen:
            tree = r.draft.tree if r.draft is not None else DraftTree()
            keep = choice.trim.get(r.request_id)
            if keep is not None and keep < len(tree):
                tree = DraftTree(tree.tokens[:keep], tree.parents[:keep], tree.probs[:keep])
            rounds.append((r, tree))
        opens = [r for r in chosen if not r.opened]
        self._plan_run(rounds, opens)
        self._start_step(lane, rounds, opens)
        return None

    def run_length(self) -> int:
        """Most steps of a decode run now: ``decode_steps``, fewer when the recent step time says they would
        take longer than ``decode_run_s``."""
        n = self.decode_steps
        if n > 1 and self._step_estimate:
            n = min(n, max(1, int(self.decode_run_s / self._step_estimate)))
        return n

    def _plan_run(self, rounds: list[tuple[Request, DraftTree]], opens: list[Request]) -> None:
        """Set each round's `Request.steps`: a decode run when no round drafted and none opens (an open's
        first token goes out at once), else one step. A run ends where the first of its requests ends (its
        length): a request ending frees a place that a new one often takes at once (a closed-loop client
        sends its next request), and the new one would otherwise wait for the rest of the run."""
        n = 1 if opens or any(len(tree) for _, tree in rounds) else self.run_length()
        if n > 1:
            n = min(request.room(max_depth=n - 1) + 1 for request, _ in rounds)
        for request, _ in rounds:
            request.steps = n

    def _start_step(self, lane: Any, rounds: list[tuple[Request, DraftTree]], opens: list[Request]) -> None:
        releases = self._releases.pop(lane, [])
        for request in opens:
            request.opened = True
        for request, _ in rounds:
            request.state = VERIFYING
        task = asyncio.get_running_loop().create_task(self.ports.verify(rounds, opens, releases))
        task.add_done_callback(lambda _: self._wake.set())
        self._steps[lane] = (task, rounds, self.clock.now())
        if rounds:
            self.steps.append([r.request_id for r, _ in rounds])
        live = len(self.requests)
        for request, tree in rounds:  # drafting ahead of this verification, when the adapter finds it pays
            self._draft_ahead(request, tree, live)

    def _draft_ahead(self, request: Request, tree: DraftTree, live: int) -> None:
        if not len(tree) or request.order is None:
            return
        main = [tree.tokens[i] for i in tree.main_chain()]
        after = len(main) + 1  # the chain and the bonus token
        room = request.room(extra=after, max_depth=self.max_depth)
        if room <= 0:
            return
        order = self.ports.plan_ahead(request, request.order, tree, room, live)
        if order is None:
            return
        order.committed, request.unsent = request.unsent, []
        order.context = main
        request.ahead = (asyncio.get_running_loop().create_task(self.ports.draft(request, order)), main, order)

    async def _finish_step(self, lane: Any = None) -> None:
        task, rounds, started = self._steps.pop(lane)
        now = self.clock.now()
        seconds = now - started
        try:
            results = task.result()
        except Exception as exc:  # noqa: BLE001 - every round of the step learns of it
            results = [exc] * len(rounds)
        if rounds:
            self._observe_step(rounds, seconds)
        done: list[tuple[Request, Verdict, policy.RoundCut, DraftTree]] = []
        for (request, tree), result in zip(rounds, results):
            if request.state != VERIFYING:
                continue  # cancelled while verified
            if isinstance(result, BaseException):
                self._fail(request, result)
                continue
            cut = policy.cut_round(list(result.token_ids), len(request.generated), request.max_new_tokens,
                                   set(request.stop_token_ids), request.context_used, request.max_context)
            done.append((request, result, cut, tree))
        if not done:
            return
        t0 = self.clock.now()
        outcomes = await self.ports.commit([(r, cut.token_ids, len(tree), min(v.accepted_draft, len(cut.token_ids)))
                                            for r, v, cut, tree in done])
        commit_s = self.clock.now() - t0
        for (request, verdict, cut, tree), outcome in zip(done, outcomes):
            if request.state != VERIFYING:
                continue  # cancelled during the commit
            if isinstance(outcome, BaseException):
                self._fail(request, outcome)
                continue
            self._round_done(request, verdict, cut, tree, seconds, commit_s, len(rounds))

    def _observe_step(self, rounds: list[tuple[Request, DraftTree]], seconds: float) -> None:
        """Learn from a step's wall time; a decode run of k steps counts as k steps of seconds / k each (with the
        rounds that still had steps left at each)."""
        k = max(r.steps for r, _ in rounds)
        seconds /= k
        a = self.smoothing
        self._step_estimate = seconds if self._step_estimate is None else (1 - a) * self._step_estimate + a * seconds
        self.time_model.add(Measurement(len(rounds), max(r.context_used for r, _ in rounds),
                                        max(len(t) for _, t in rounds), seconds))
        if self.on_step is not None:
            for i in range(k):
                self.on_step(sum(1 for r, _ in rounds if r.steps > i), seconds)

    def _round_done(self, request: Request, verdict: Verdict, cut: policy.RoundCut, tree: DraftTree, verify_s: float,
                    commit_s: float, batch_size: int) -> None:
        accepted = min(verdict.accepted_draft, len(cut.token_ids))
        request.generated += cut.token_ids
        request.unsent += cut.token_ids
        request.step += 1
        request.rounds += 1
        request.drafted += len(tree)
        request.lookup_drafted += verdict.lookup_drafted
        request.lookup_accepted += min(verdict.lookup_accepted, len(cut.token_ids) - accepted)
        request.accepted += accepted
        draft = request.draft
        if draft is not None and len(tree):
            for name in draft.drafters:
                if name not in request.drafters_used:
                    request.drafters_used.append(name)
        now = self.clock.now()
        self.ports.learn(request, RoundRecord(request.order, draft, tree, verdict,
                                              list(cut.token_ids), request.draft_s, verify_s, commit_s,
                                              now - request.round_started, batch_size, request.steps))
        request.draft, request.draft_s = None, 0.0
        self.ports.emit(request, Emission(list(cut.token_ids), len(tree), accepted, cut.finish_reason))
        if cut.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._end(request)
            return
        request.state = IDLE
        if request.ahead is not None:
            self._await_ahead(request, verdict)

    def _await_ahead(self, request: Request, verdict: Verdict) -> None:
        """The request's next draft is the part of the tree drafted ahead that fits the verdict, if any."""
        task, main, order = request.ahead
        request.ahead = None
        request.state = DRAFTING
        request.round_started = request.draft_started = self.clock.now()
        request.task = self._spawn(self._ahead_outcome(request, task, main, order, verdict), request, timed=False)

    async def _ahead_outcome(self, request: Request, task: asyncio.Task, main: list[int], order: RoundOrder,
                             verdict: Verdict) -> Draft | None:
        draft = await task
        tokens = list(verdict.token_ids)
        sub = None
        if verdict.accepted_draft == len(main) and len(tokens) == len(main) + 1 and tokens[:-1] == main:
            sub = subtree_after(draft.tree, tokens[-1:])
            room = request.room(max_depth=self.max_depth)
            if sub is not None and len(sub) and room > 0:
                sub = subtree_after(sub, [], room)
        used = sub is not None and len(sub) > 0
        self.ports.observe_ahead(request, draft, order, used)
        if not used:
            return None
        request.order = RoundOrder(max(sub.depths(), default=0), list(order.drafters))
        return Draft(sub, list(order.drafters), 0.0, None)

    # -- ends ------------------------------------------------------------------------

    def _fail(self, request: Request, exc: BaseException) -> None:
        if request.state == ENDED:
            return
        self._end(request)
        self.ports.emit(request, Emission(error=exc))

    def _end(self, request: Request) -> None:
        if request.state == ENDED:
            return
        request.state = ENDED
        for task in (request.task, request.ahead[0] if request.ahead else None):
            if task is not None and not task.done():
                task.cancel()
        request.task, request.ahead = None, None
        self.requests.pop(request.request_id, None)
        if request.opened:
            self._releases.setdefault(request.lane, []).append(request.request_id)
