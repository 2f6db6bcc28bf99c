"""gRPC adapter of the scheduler: feeds each Submit stream into the step loop and implements the loop's ports.

The loop (`cosine.scheduler.steploop`) runs every live request's rounds as steps; this
module only translates: drafts over each request's Speculate stream to fusion, a step's
verifications as one message on one long-lived VerifySteps stream to the verifier, a
step's commits as one Redis pipeline, and each request's rounds back to its Submit stream.

Replicas: a new request is placed on the least-loaded ready verifier and fusion replica
(`cosine.common.pool`) and stays there — its KV caches live there. Each verifier is a lane of
the step loop with its own VerifySteps stream, so several verifiers verify at once.

Verifier failover (DESIGN §5): when a verifier's stream breaks, every request open on it moves to
another ready verifier; the rounds of the broken step are verified again there at once, after an
open with the request's committed tokens (the new verifier rebuilds the KV cache from them), and
the others reopen with their next round. Nothing of the broken step was committed, and the target's
choice at each position depends only on the committed tokens and (seed, position), so the output
is the fault-free one. A request whose verifier's stream was reopened (the same verifier, restarted)
is reopened the same way.
"""

from __future__ import annotations

import asyncio
import time
import logging
from dataclasses import asdict, dataclass, field

import grpc
from prometheus_client import Counter, Gauge, Histogram

from cosine.common.convert import (FUSION_MODE_PROTO, fusion_mode_name, sampling_from_dict, sampling_from_proto,
                                   sampling_to_dict, sampling_to_proto)
from cosine.common.errors import ServiceError, invalid
from cosine.common.metrics import LATENCY_BUCKETS
from cosine.common.picking import Candidate, free_slots
from cosine.common.pool import Endpoint, EndpointPool
from cosine.common.state import RequestStore
from cosine.common.streams import close_quietly, exchange
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc
from cosine.scheduler.routing import ExpertiseRouter, PromptFit
from cosine.engine.tree import DraftTree
from cosine.scheduler.adaptive import CostModel, DepthChooser, LoadMeter, verifier_load
from cosine.common.batching import BatchLimits
from cosine.scheduler.speculation import RequestSpeculation, SpeculationController, SpeculationGate
from cosine.scheduler.steploop import Clock, Draft, Emission, MonotonicClock, Request, RoundOrder, RoundRecord, StepLoop, Verdict
from cosine.scheduler.switches import Switches
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerMetrics:
    def __init__(self, registry):
        self.rounds = Counter("cosine_scheduler_rounds_total", "speculation rounds run", registry=registry)
        self.drafted = Counter("cosine_scheduler_drafted_tokens_total", "draft tokens sent to verification", registry=registry)
        self.accepted = Counter("cosine_scheduler_accepted_tokens_total", "draft tokens the target accepted", registry=registry)
        self.accepted_len = Histogram(
            "cosine_scheduler_accepted_length", "tokens committed per round (accepted + 1)", buckets=(1, 2, 3, 4, 5, 6, 8, 12, 16), registry=registry
        )
        self.draft_seconds = Histogram("cosine_scheduler_draft_seconds", "drafting time per round", buckets=LATENCY_BUCKETS, registry=registry)
        self.verify_seconds = Histogram("cosine_scheduler_verify_seconds", "verification time per round", buckets=LATENCY_BUCKETS, registry=registry)
        self.draft_compute_seconds = Histogram(
            "cosine_scheduler_draft_compute_seconds", "drafting time per round as fusion measured it", buckets=LATENCY_BUCKETS, registry=registry)
        self.verify_compute_seconds = Histogram(
            "cosine_scheduler_verify_compute_seconds", "verification time per round as the verifier measured it", buckets=LATENCY_BUCKETS, registry=registry)
        self.commit_seconds = Histogram("cosine_scheduler_commit_seconds", "Redis commit time per round", buckets=LATENCY_BUCKETS, registry=registry)
        self.live = Gauge("cosine_scheduler_requests_in_flight", "requests whose rounds this scheduler runs now", registry=registry)
        self.depth = Histogram("cosine_scheduler_depth", "draft depth chosen per round (0: plain decoding)",
                               buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16), registry=registry)
        self.depth_cap = Gauge("cosine_scheduler_depth_cap", "global depth cap of adaptive speculation control", registry=registry)
        self.drafters_cap = Gauge("cosine_scheduler_drafters_cap", "drafters per request expertise routing exploits", registry=registry)
        self.ahead = Counter("cosine_scheduler_draft_ahead_total", "rounds drafted ahead of a verification, by outcome",
                             ["outcome"], registry=registry)
        self.routed = Counter("cosine_scheduler_drafter_selected_total", "rounds each drafter was selected for", ["drafter"], registry=registry)
        self.first_choice = Counter("cosine_scheduler_routing_first_choice_total",
                                    "requests whose first round expertise routing gave to each drafter (from the prompt prior)",
                                    ["drafter"], registry=registry)
        # acceptance by position: position p of the drafted chain (0 = the first draft token) was drafted / accepted
        self.position_drafted = Counter("cosine_scheduler_position_drafted_total", "rounds whose tree reached draft position p",
                                        ["position"], registry=registry)
        self.position_accepted = Counter("cosine_scheduler_position_accepted_total", "rounds whose draft token at position p was accepted",
                                         ["position"], registry=registry)
        self.step_size = Histogram("cosine_scheduler_step_size", "requests verified in one step of the step loop",
                                   buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=registry)
        self.gate = Gauge("cosine_scheduler_speculation_gate",
                          "1 while adaptive requests may draft, 0 while the speculation gate measured plain decoding faster "
                          "at the present load", registry=registry)
        self.step_seconds = Histogram("cosine_scheduler_step_seconds", "wall time of one verification step (send to answer)",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.failovers = Counter("cosine_scheduler_verifier_failovers_total",
                                 "requests moved to another verifier after their verifier's stream broke", registry=registry)
        self.fusion_failovers = Counter(
            "cosine_scheduler_fusion_failovers_total",
            "requests whose fusion stream failed or passed its deadline, by what followed: reopened at another fusion "
            "replica, or plain decoding for the rest of the request", ["outcome"], registry=registry)
        for position in range(16):  # exported from the start, so rates by position exist before the first accept
            self.position_drafted.labels(str(position))
            self.position_accepted.labels(str(position))


@dataclass
class SchedulerConfig:
    default_depth: int = 4
    max_depth: int = 16
    max_context: int = 8192
    switches: Switches = field(default_factory=Switches)
    routing_k: int = 2  # drafters expertise routing exploits at first (the controller moves it)
    routing_max_k: int = 3
    routing_threshold: float = 1.0  # recent accepted length below which routing adds a less-tried drafter
    control_interval_s: float = 0.5  # how often the global controller reads the verifier's load
    verifier_queue_high: int = 4  # requests waiting on the verifier at which speculation shrinks
    step_max_requests: int = 16  # most requests verified in one step
    step_max_tokens: int = 256  # most positions verified in one step (Σ 1 + tree nodes)
    gate_window_s: float = 0.5  # the speculation gate's window (0: no gate, adaptive requests always may draft)
    draft_deadline_s: float = 3.0  # shortest deadline of a round's drafts (10 × the measured draft time, at least this)
    first_draft_deadline_s: float = 15.0  # deadline of a request's first round (the drafters prefill its prompt)
    verify_deadline_s: float = 5.0  # shortest deadline of a verification step (10 × the measured step, at least this)
    open_deadline_s: float = 30.0  # shortest deadline of a step that opens requests (the verifier prefills them)
    fusion_retry_s: float = 5.0  # a request decoding plainly for want of fusion tries a ready replica again after this
    decode_steps: int = 4  # most tokens of a decode run: plain steps the verifier runs back to back (1: none)
    decode_run_s: float = 0.1  # a decode run's steps fit in this, by the recent step time
    lookup_tokens: int = 8  # most tokens the verifier looks up and verifies with each plain step of an adaptive request


def request_switches(server: Switches, spec: common_pb2.SpeculationParams) -> Switches:
    """The server's switches with the request's own (unset fields keep the server's)."""
    changes = {}
    if spec.fusion != common_pb2.FUSION_MODE_UNSPECIFIED:
        changes["fusion"] = fusion_mode_name(spec.fusion)
    if spec.HasField("routing"):
        changes["routing"] = spec.routing
    if spec.HasField("adaptive_depth"):
        changes["adaptive_depth"] = spec.adaptive_depth
    if spec.HasField("pipelining"):
        changes["pipelining"] = spec.pipelining
    return server.replace(**changes) if changes else server


def restore_plan(plan: "RequestPlan", policy_state: dict | None) -> None:
    """A resumed request continues from what it learnt (the last commit's policy state in Redis)."""
    if not policy_state:
        return
    routing = policy_state.get("routing")
    if plan.router is not None and routing and {ev["name"] for ev in routing.get("evidence", [])} == set(plan.router.evidence):
        plan.router = ExpertiseRouter.from_dict(routing)
    speculation = policy_state.get("speculation")
    if plan.depth is not None and speculation:
        plan.depth = DepthChooser(RequestSpeculation(**speculation))


@dataclass
class RequestPlan:
    """How one request speculates: its switches, the drafters fusion may use, and the per-request policies."""

    switches: Switches
    pool: list[str]  # drafters opened at fusion
    fixed: list[str]  # the drafters of every round when not routed
    router: ExpertiseRouter | None
    depth: DepthChooser | None  # None: fixed depth
    fixed_depth: int

    @property
    def speculate(self) -> bool:
        return bool(self.pool)

    def state(self) -> dict | None:
        """What the request has learnt, JSON-safe, for Redis (None: nothing to keep)."""
        out = {}
        if self.router is not None:
            out["routing"] = self.router.to_dict()
        if self.depth is not None:
            out["speculation"] = asdict(self.depth.speculation)
        return out or None


@dataclass
class LiveRequest:
    """The adapter's side of a request in the step loop: its plan, its stream to fusion, its Submit queue, spans."""

    plan: RequestPlan
    spec_call: object  # the Speculate stream to fusion; None without speculation
    sampling: common_pb2.SamplingParams
    prompt: list[int]
    queue: asyncio.Queue  # Emissions for the Submit stream
    submit_context: dict  # the Submit span's trace context: the parent of each round's span
    verifier: Endpoint | None = None  # the verifier replica the request is placed on (its lane in the step loop)
    stream: int = -1  # generation of that verifier's VerifySteps stream the request was opened on
    epoch: int = 0  # the owner fence in Redis (cosine.common.state)
    resumed: bool = False  # taken over from Redis (another scheduler's, or this one's, broken stream)
    sent: int = 0  # output tokens sent on the Submit stream so far (the next one's index)
    fusion: Endpoint | None = None  # the fusion replica spec_call goes to (None: plain decoding)
    fusion_generation: int = 0  # bumped when the request reopens at another fusion replica
    fusion_fresh: bool = True  # spec_call has answered no round yet (its drafters prefill on the first)
    fusion_lost_at: float | None = None  # when the request last lost (or never had) a fusion stream
    timeout_at: float | None = None  # the Submit call's deadline (time.monotonic()), for a reopened Speculate stream
    metadata: tuple = ()  # trace metadata of the Speculate streams
    fusion_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _round: object = None

    def round_span(self, tracing: Tracing):
        """The current round's span, started on first use."""
        if self._round is None:
            self._round = tracing.start("scheduler.round", parent=self.submit_context)
        return self._round

    def end_round(self) -> None:
        if self._round is not None:
            self._round.end()
            self._round = None


class Handover(Exception):
    """The request leaves this scheduler with everything committed in Redis: its caller resumes it elsewhere."""


class TakenOver(ServiceError):
    def __init__(self, request_id: str):
        super().__init__(grpc.StatusCode.ABORTED, f"request {request_id} was taken over by another scheduler (resumed)")


def _entry_error(error: verifier_pb2.VerifyEntryError) -> ServiceError:
    try:
        code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
    except StopIteration:
        code = grpc.StatusCode.INTERNAL
    return ServiceError(code, error.message)


def tree_depth(parents) -> int:
    """Longest root-to-leaf path of a draft tree (nodes are in topological order)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


@dataclass
class VerifierLane:
    """The scheduler's VerifySteps stream to one verifier replica."""

    endpoint: Endpoint
    call: object = None  # opened with the first step
    generation: int = 0  # bumped whenever the stream is (re)opened or breaks: requests opened on an older one are gone
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one exchange at a time (a failover replays on another lane)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        store: RequestStore,
        verifiers: EndpointPool,
        fusions: EndpointPool,
        config: SchedulerConfig,
        metrics: SchedulerMetrics,
        tracing: Tracing | None = None,
        clock: Clock | None = None,
    ):
        self.clock = clock or MonotonicClock()  # the step loop's and the controller's (`cosine plan` runs a simulated one)
        self.store = store
        self.verifiers = verifiers
        self.fusions = fusions
        self.config = config
        self.metrics = metrics
        self.tracing = tracing or Tracing("scheduler")
        self.live: dict[str, object] = {}  # request id → its LiveRequest (a placeholder while it starts)
        metrics.live.set_function(lambda: len(self.live))
        self.max_admitted = 0  # admission: most live requests; 0: the ready verifiers' KV slots
        self.draining = False  # SIGTERM: new requests are refused, live ones finish or are handed over
        self._heartbeat: asyncio.Task | None = None
        sw = config.switches
        self.costs = CostModel()
        self.load = LoadMeter(self.clock.now())
        self.controller = SpeculationController(
            max_depth=config.max_depth, max_drafters=max(1, config.routing_max_k),
            depth_cap=min(config.default_depth, config.max_depth), drafters=max(1, min(config.routing_k, config.routing_max_k)),
            queue_high=max(1, config.verifier_queue_high), adaptive=sw.adaptive_depth)
        self._controlled_at = self.clock.now()
        metrics.depth_cap.set_function(lambda: self.controller.depth_cap)
        metrics.drafters_cap.set_function(lambda: self.controller.drafters)
        self.loop = StepLoop(self, BatchLimits(max_tokens=max(2, config.step_max_tokens), max_requests=max(1, config.step_max_requests)),
                             clock=self.clock, max_depth=config.max_depth, on_step=self._on_step,
                             decode_steps=config.decode_steps, decode_run_s=config.decode_run_s)
        self.gate = SpeculationGate(window_s=config.gate_window_s) if config.gate_window_s > 0 else None
        metrics.gate.set_function(lambda: 1 if self.gate is None or self.gate.speculating else 0)
        self.lanes: dict[str, VerifierLane] = {}  # verifier endpoint name -> its stream
        self._opened_on: dict[str, str] = {}  # request id -> the lane it is open on (until released)

    @property
    def max_requests(self) -> int:
        """Admission: most live requests (0: no limit) — max_admitted, else the KV slots the ready verifiers
        report (their load reports' capacity; unknown while any ready one reports none)."""
        if self.max_admitted:
            return self.max_admitted
        ready = [e for e in self.verifiers.endpoints() if e.healthy and e.report is not None]
        return sum(e.report.capacity for e in ready) if ready and all(e.report.capacity for e in ready) else 0

    def _full(self) -> bool:
        """Admission: --max-admitted live requests; else no free KV slot on any ready verifier, counting other
        schedulers' requests on them (their load reports) as well as this one's, so schedulers that share a
        verifier do not each fill it (`cosine.common.picking.free_slots`)."""
        if self.max_admitted:
            return len(self.live) >= self.max_admitted
        ready = [e for e in self.verifiers.endpoints() if e.healthy and e.report is not None]
        free = free_slots([Candidate(e.load, e.placed) for e in ready])
        return free is not None and free <= 0

    def plan(self, request: scheduler_pb2.SubmitRequest) -> RequestPlan:
        """Resolve a request's switches and drafters (see the module's notes on routing)."""
        spec = request.speculation
        try:
            sw = request_switches(self.config.switches, spec)
        except ValueError as exc:
            raise invalid(f"speculation switches: {exc}") from None
        named = list(dict.fromkeys(spec.drafters))
        candidates = list(dict.fromkeys(request.candidate_drafters))
        router = None
        if spec.disabled or not (named or candidates):
            pool, fixed = [], []
        elif candidates and sw.routing:
            pool, fixed = candidates, []
            router = ExpertiseRouter(candidates, k=1 if sw.fusion == "single" else self.controller.drafters,
                                     threshold=self.config.routing_threshold)
        elif candidates:  # routing off: the fixed drafter (the switch's, else the router's first choice)
            first = sw.fixed_drafter if sw.fixed_drafter in candidates else (named or candidates)[0]
            pool = fixed = [first]
        else:  # the client named its drafters: exactly those
            pool = fixed = named
        requested = spec.max_depth if spec.HasField("max_depth") else None
        fixed_depth = min(sw.fixed_depth if requested is None else requested, self.config.max_depth)
        chooser = None
        if sw.adaptive_depth and pool:
            limit = min(self.config.max_depth if requested is None else requested, self.config.max_depth)
            chooser = DepthChooser(RequestSpeculation(max_depth=limit))
        return RequestPlan(sw, pool, fixed, router, chooser, fixed_depth if pool else 0)

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        if not rid or not prompt or request.max_new_tokens == 0:
            raise invalid("Submit needs a request_id, prompt tokens and max_new_tokens > 0")
        if len(prompt) + request.max_new_tokens > self.config.max_context:
            raise invalid(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the target's context "
                f"limit of {self.config.max_context} tokens: shorten the prompt or ask for fewer tokens"
            )
        if self.draining:  # its caller resubmits it elsewhere at once, as it does a handed-over request
            yield scheduler_pb2.SubmitResponse(request_id=rid, handover=scheduler_pb2.Handover(
                reason="this scheduler is shutting down; submit the request to another"))
            return
        if rid in self.live:
            if not request.resume:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already running")
            self._evict(rid, TakenOver(rid))  # this scheduler's own earlier stream of it broke: the resume replaces it
        elif self._full():  # admission: what the verifiers' KV slots hold
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the server is at capacity ({self.max_requests} requests in progress); retry later, with backoff")
        mine = [object()]  # this Submit's entry in self.live (its LiveRequest once it runs)
        self.live[rid] = mine[0]  # counted at once, so concurrent Submits cannot all pass the check
        try:
            async for reply in self._run(request, context, mine):
                yield reply
        finally:
            if self.live.get(rid) is mine[0]:
                del self.live[rid]

    async def _run(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext, mine: list):
        rid = request.request_id
        plan = self.plan(request)
        drafters = plan.pool
        state = await self.store.take_over(rid) if request.resume else None
        if state is not None and state.status == "finished":  # it ended before its caller heard: send the rest
            tokens = state.token_ids[request.resume_from:]
            if tokens:
                yield scheduler_pb2.SubmitResponse(request_id=rid, tokens=scheduler_pb2.CommittedTokens(
                    token_ids=tokens, start_index=request.resume_from))
            stats = common_pb2.Stats(rounds=state.rounds, drafted_tokens=state.drafted, accepted_tokens=state.accepted)
            yield scheduler_pb2.SubmitResponse(request_id=rid, final=scheduler_pb2.SubmitFinal(
                finish_reason=common_pb2.FinishReason.Value(state.finish_reason or "FINISH_REASON_LENGTH"), stats=stats))
            return
        verifier = self.verifiers.pick()  # UNAVAILABLE before anything is stored when none is ready
        fusion = self._pick_fusion() if plan.speculate else None  # none ready: plain decoding (drafting is optional)
        if state is None:  # a new request (or one whose state never reached Redis): from this message
            prompt, generated = list(request.prompt_token_ids), []
            sampling = request.sampling
            max_new, stop = request.max_new_tokens, list(request.stop_token_ids)
            try:
                epoch = await self.store.create(
                    rid, prompt,
                    sampling_to_dict(sampling_from_proto(sampling)),
                    {"max_new_tokens": max_new, "drafters": drafters, "depth": plan.fixed_depth, "stop_token_ids": stop},
                )
            except BaseException:
                self._unplace(verifier, fusion)
                raise
            if not epoch:
                self._unplace(verifier, fusion)
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already running")
        else:  # taken over: Redis is the source of truth (tokens, the seed, limits, what routing and depth learnt)
            prompt, generated, epoch = state.prompt_token_ids, state.token_ids, state.epoch
            sampling = sampling_to_proto(sampling_from_dict(state.sampling))
            max_new = int(state.params.get("max_new_tokens", request.max_new_tokens))
            stop = list(state.params.get("stop_token_ids", request.stop_token_ids))
            restore_plan(plan, state.policy)
        status, reason = "failed", ""
        timeout = context.time_remaining()
        metadata = self.tracing.metadata()  # the streams' server spans are children of this Submit
        spec_call = (fusion_pb2_grpc.FusionStub(fusion.channel).Speculate(timeout=timeout, metadata=metadata)
                     if fusion is not None else None)
        live = LiveRequest(plan, spec_call, sampling, prompt, asyncio.Queue(), self.tracing.carrier(), verifier, epoch=epoch,
                           resumed=state is not None, sent=request.resume_from if state is not None else 0, fusion=fusion,
                           timeout_at=None if timeout is None else time.monotonic() + timeout, metadata=metadata)
        if plan.speculate and fusion is None:
            live.fusion_lost_at = self.clock.now()
        if self.live.get(rid) is mine[0]:
            self.live[rid] = mine[0] = live
        self._ensure_heartbeat()
        try:
            if state is not None and live.sent < len(generated):  # committed, but its caller never got them
                yield scheduler_pb2.SubmitResponse(request_id=rid, tokens=scheduler_pb2.CommittedTokens(
                    token_ids=generated[live.sent:], start_index=live.sent))
                live.sent = len(generated)
            if spec_call is not None:
                score = plan.router is not None and not (state is not None and state.policy and "routing" in state.policy) \
                    and self._worth_scoring(plan)
                opening = fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
                    request_id=rid, prompt_token_ids=prompt + generated, drafters=drafters,
                    fusion=FUSION_MODE_PROTO[plan.switches.fusion], score_prompt=score))
                try:
                    if not score:
                        await asyncio.wait_for(spec_call.write(opening), self.config.first_draft_deadline_s)
                    else:  # routing's prior: every candidate prefills the prompt and says how well it predicted it
                        with self.tracing.span("scheduler.score_prompt", {"cosine.drafters": len(drafters)}):
                            scored = await asyncio.wait_for(exchange(spec_call, opening, "fusion"),
                                                            self.config.first_draft_deadline_s)
                        self._prior(plan.router, scored.prompt_fits)
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception as exc:  # noqa: BLE001 - fusion failed: the request decodes plainly
                    self._fusion_broke(live, exc, request_id=rid)
                    self.metrics.fusion_failovers.labels("plain").inc()
            entry = Request(rid, len(prompt), max_new, self.config.max_context, frozenset(stop), payload=live,
                            lane=verifier.name, lookup=self.config.lookup_tokens if plan.speculate and plan.depth is not None else 0)
            if state is not None:
                entry.generated, entry.step = list(generated), state.step
                entry.rounds, entry.drafted, entry.accepted = state.rounds, state.drafted, state.accepted
            finish = self._ended(entry, generated) if state is not None else common_pb2.FINISH_REASON_UNSPECIFIED
            if finish != common_pb2.FINISH_REASON_UNSPECIFIED:  # its last round was committed before its owner died
                status, reason = "finished", common_pb2.FinishReason.Name(finish)
                yield scheduler_pb2.SubmitResponse(request_id=rid, final=scheduler_pb2.SubmitFinal(
                    finish_reason=finish, stats=common_pb2.Stats(rounds=entry.rounds, drafted_tokens=entry.drafted,
                                                                 accepted_tokens=entry.accepted)))
                return
            self.loop.add(entry)
            while True:
                emission: Emission = await live.queue.get()  # the step loop emits this request's rounds into its queue
                if isinstance(emission.error, Handover):
                    status = "handed_over"
                    yield scheduler_pb2.SubmitResponse(request_id=rid, handover=scheduler_pb2.Handover(reason=str(emission.error)))
                    return
                if emission.error is not None:
                    raise emission.error
                yield scheduler_pb2.SubmitResponse(request_id=rid, tokens=scheduler_pb2.CommittedTokens(
                    token_ids=emission.token_ids, drafted_tokens=emission.drafted, accepted_tokens=emission.accepted,
                    start_index=live.sent))
                live.sent += len(emission.token_ids)
                if emission.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    status, reason = "finished", common_pb2.FinishReason.Name(emission.finish_reason)
                    stats = common_pb2.Stats(rounds=entry.rounds, drafted_tokens=entry.drafted, accepted_tokens=entry.accepted,
                                             drafters=entry.drafters_used, lookup_drafted_tokens=entry.lookup_drafted,
                                             lookup_accepted_tokens=entry.lookup_accepted)
                    yield scheduler_pb2.SubmitResponse(request_id=rid, final=scheduler_pb2.SubmitFinal(
                        finish_reason=emission.finish_reason, stats=stats))
                    return
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away: cancelled, or closed while we waited at a yield
            status = "cancelled"
            raise
        except TakenOver:
            status = "taken_over"
            raise
        finally:
            if self.loop.requests.get(rid) is not None and self.loop.requests[rid].payload is live:
                self.loop.cancel(rid)
            live.end_round()
            close_quietly(live.spec_call)
            self._unplace(live.verifier, live.fusion)  # failover may have moved it to other replicas
            if status not in ("handed_over", "taken_over"):  # the request's next owner writes its state from now on
                try:
                    await asyncio.shield(self.store.finish(rid, status, reason, epoch=live.epoch))
                except Exception:  # noqa: BLE001 - the TTL set at creation still bounds the state
                    log.warning("could not mark request %s %s in Redis", rid, status, exc_info=True)

    @staticmethod
    def _ended(entry: Request, generated: list[int]) -> int:
        """The finish reason of a resumed request whose committed tokens already end it (0: it goes on)."""
        if generated and generated[-1] in entry.stop_token_ids:
            return common_pb2.FINISH_REASON_EOS
        if len(generated) >= entry.max_new_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        if entry.context_used >= entry.max_context:
            return common_pb2.FINISH_REASON_CONTEXT
        return common_pb2.FINISH_REASON_UNSPECIFIED

    def _evict(self, rid: str, error: BaseException) -> None:
        """End a live request here with `error` on its Submit stream (a Handover, or fenced off: TakenOver)."""
        live = self.live.get(rid)
        self.loop.cancel(rid)
        if isinstance(live, LiveRequest):
            live.queue.put_nowait(Emission(error=error))

    def _ensure_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._renew_leases())

    async def _renew_leases(self) -> None:
        """Keep the leases of the requests this scheduler owns alive in Redis (a third of the lease apart), and end
        the ones another scheduler took over."""
        interval = max(0.05, self.store.lease_ms / 3000)
        while True:
            await asyncio.sleep(interval)
            owned = [(rid, live.epoch) for rid, live in self.live.items() if isinstance(live, LiveRequest)]
            if not owned:
                continue
            try:
                kept = await self.store.renew_many(owned)
            except Exception:  # noqa: BLE001 - Redis is down: commits fail with UNAVAILABLE meanwhile
                log.debug("could not renew leases", exc_info=True)
                continue
            for (rid, epoch), ok in zip(owned, kept):
                live = self.live.get(rid)
                if not ok and isinstance(live, LiveRequest) and live.epoch == epoch:
                    self._evict(rid, TakenOver(rid))

    async def drain(self, handover_after_s: float) -> None:
        """SIGTERM: refuse new requests; let live ones finish for `handover_after_s`, then hand the rest over
        (their callers resume them elsewhere from Redis). Their verifier caches are released first, so the
        next owner can open them at once."""
        self.draining = True
        deadline = time.monotonic() + handover_after_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leaving = [(rid, live) for rid, live in self.live.items() if isinstance(live, LiveRequest)]
        if not leaving:
            return
        log.info("handing %d requests over (drain)", len(leaving))
        for rid, _ in leaving:
            self.loop.cancel(rid)
        waited = time.monotonic()
        while not self.loop.quiet and time.monotonic() - waited < 2.0:  # the releases reach the verifier
            await asyncio.sleep(0.01)
        for rid, live in leaving:
            live.queue.put_nowait(Emission(error=Handover("the scheduler is shutting down; resume the request elsewhere")))
        waited = time.monotonic()
        while self.live and time.monotonic() - waited < 2.0:  # the streams carry the handover out
            await asyncio.sleep(0.01)

    def _unplace(self, verifier: Endpoint, fusion: Endpoint | None) -> None:
        """The request no longer holds its verifier and fusion replicas (their pools count it no more)."""
        self.verifiers.release(verifier)
        if fusion is not None:
            self.fusions.release(fusion)

    def _round_plan(self, plan: RequestPlan, room: int) -> tuple[int, list[str], int]:
        """(depth, drafters, tree budget) of the next round; `room` caps the depth (length, context)."""
        if not plan.speculate or room <= 0:
            return 0, [], 0
        if plan.depth is not None and not self._gate_open():
            return 0, [], 0  # adaptive: plain decoding has been faster for the server at this load
        if plan.router is not None:
            if plan.switches.fusion != "single":
                plan.router.k = self.controller.drafters
            drafters = plan.router.select()
        else:
            drafters = list(plan.fixed)
        if plan.switches.fusion == "single":  # one drafter: the best, or the one routing explores
            explore = plan.router is not None and plan.router.exploring() and len(drafters) > plan.router.k
            drafters = drafters[-1:] if explore else drafters[:1]
        if plan.depth is None:
            return min(plan.fixed_depth, room), drafters, 0
        d = min(plan.depth.choose(self.costs.costs((plan.switches.fusion, len(drafters))), self.controller.depth_cap), room)
        budget = 0
        if d > 0 and plan.switches.fusion == "confidence":  # side branches in proportion to the uncertainty
            budget = plan.depth.speculation.budget(d, 1.0, max_budget=d * (1 + len(drafters)))
        return d, drafters, budget

    def _worth_scoring(self, plan: RequestPlan) -> bool:
        """Routing's prior costs every candidate drafter a prefill of the prompt, on cores the verifier shares,
        before the request's first token. Not while the gate judges that speculation does not pay at this load:
        the request decodes plainly, its drafters open only if it drafts later, and routing then learns online."""
        if plan.depth is None or self.gate is None:
            return True
        return self.gate.pays(self.loop.live + 1) is not False

    def _gate_open(self) -> bool:
        return self.gate is None or self.gate.speculate(self.clock.now(), self.loop.live)

    def _control(self) -> None:
        """Move the global caps from the verifiers' load, at most every control_interval_s: this scheduler's own
        reading, and what the verifiers it uses report (other schedulers' requests included)."""
        now = self.clock.now()
        if now - self._controlled_at >= self.config.control_interval_s:
            self._controlled_at = now
            idle, queue = self.load.read(now)
            used = {live.verifier.name for live in (r.payload for r in self.loop.requests.values()) if live.verifier}
            endpoints = self.verifiers.endpoints() if self.verifiers is not None else []
            reports = [(e.busy_share, e.report.queued) for e in endpoints
                       if e.name in used and e.healthy and e.report is not None]
            self.controller.update_load(*verifier_load(idle, queue, reports))

    # -- the step loop's ports (cosine.scheduler.steploop) over fusion, the verifier and Redis ------------

    def plan_round(self, request: Request, room: int) -> RoundOrder:
        live: LiveRequest = request.payload
        live.round_span(self.tracing)
        if live.spec_call is None and not self._fusion_back(live):
            return RoundOrder(0)
        if not request.opened and live.plan.depth is not None:
            # adaptive: the step that opens a request on its verifier prefills it and gives its first token;
            # a draft for it would put the drafters' prefill of the prompt (and the wait for it) before the
            # verifier's prefill, and both before the first token
            return RoundOrder(0)
        d, drafters, budget = self._round_plan(live.plan, room)
        return RoundOrder(d, drafters, budget)

    def plan_ahead(self, request: Request, order: RoundOrder, tree: DraftTree, room: int, live_count: int) -> RoundOrder | None:
        """Draft the next round while this one is verified (pipelining with one request in flight), assuming this
        round's main chain is accepted whole, unless it would not hide behind the verification."""
        live: LiveRequest = request.payload
        report = live.verifier.report if live.verifier is not None else None
        if report is not None:  # requests of other schedulers on the same verifier count too
            live_count = max(live_count, report.live_requests)
        if live.spec_call is None or not live.plan.switches.pipelining or live_count != 1:
            return None
        if live.plan.depth is not None and self.gate is not None and not self.gate.speculating:
            return None
        ahead_depth = min(max(order.depth, 1), room) + 1  # the first level guesses the bonus token
        costs = self.costs.costs((live.plan.switches.fusion, len(order.drafters)))
        if costs is not None and costs.draft_overhead_s + costs.draft_step_s * ahead_depth > \
                costs.verify_s + costs.verify_per_token_s * len(tree):
            return None  # the request would wait for it
        return RoundOrder(ahead_depth, list(order.drafters))

    async def draft(self, request: Request, order: RoundOrder) -> Draft:
        """The round's draft tree from fusion. Drafting is optional: when the request's fusion stream fails or
        passes its deadline, the request reopens at another fusion replica (with everything it committed) and
        drafts there; with none, this round and the rest of the request decode plainly (an empty tree)."""
        live: LiveRequest = request.payload
        generation = live.fusion_generation
        broke = False
        async with live.fusion_lock:  # one stream, in order
            for _ in range(2):  # its fusion replica (or, decoding plainly, a ready one again), then another
                if live.spec_call is None and not await self._reopen_fusion(request):
                    break
                # a stream reopened after this order was made has every committed token from its open
                committed = order.committed if live.fusion_generation == generation else []
                try:
                    return await self._speculate_round(request, order, committed)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - fusion failed or hung: not the request's failure
                    self._fusion_broke(live, exc, request_id=request.request_id)
                    broke = True
        if broke:
            self.metrics.fusion_failovers.labels("plain").inc()
        return Draft(DraftTree(), [], 0.0, None)

    def _fusion_back(self, live: LiveRequest) -> bool:
        """A request decoding plainly for want of fusion drafts again (reopening at a ready replica) once
        fusion_retry_s passed since it lost its stream."""
        return (live.plan.speculate and live.fusion_lost_at is not None
                and self.clock.now() - live.fusion_lost_at >= self.config.fusion_retry_s
                and any(e.healthy for e in self.fusions.endpoints()))

    async def _speculate_round(self, request: Request, order: RoundOrder, committed: list[int]) -> Draft:
        live: LiveRequest = request.payload
        span = self.tracing.start("scheduler.draft", {"cosine.depth": order.depth, "cosine.drafters": order.drafters},
                                  parent=live.round_span(self.tracing))
        try:
            message = fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(
                committed_token_ids=committed, depth=order.depth, drafters=order.drafters, budget=order.budget,
                context_token_ids=order.context))
            self.tracing.carrier(span, message.round.trace_context)
            deadline = (self.config.first_draft_deadline_s if live.fusion_fresh
                        else max(self.config.draft_deadline_s, 10 * (request.draft_estimate or 0.0)))
            try:
                reply = await asyncio.wait_for(exchange(live.spec_call, message, "fusion"), deadline)
            except asyncio.TimeoutError:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"fusion did not draft within {deadline:.1f} s") from None
            live.fusion_fresh = False
        finally:
            span.end()
        tree = DraftTree(list(reply.tree.token_ids), list(reply.tree.parents), list(reply.tree.probs))
        return Draft(tree, list(order.drafters), reply.draft_ms / 1000, reply)

    def _pick_fusion(self) -> Endpoint | None:
        """A ready fusion replica for a request (placed there), or None: the request decodes plainly."""
        try:
            return self.fusions.pick()
        except ServiceError:
            log.warning("no fusion replica is ready: a request decodes plainly")
            return None

    def _fusion_broke(self, live: LiveRequest, exc: BaseException, request_id: str) -> None:
        """The request's fusion stream failed: close it, and take the replica out of new placements when it is
        gone or hung (not when it refused this one request)."""
        if live.spec_call is None:
            return
        close_quietly(live.spec_call)
        live.spec_call = None
        live.fusion_lost_at = self.clock.now()
        code = exc.code if isinstance(exc, ServiceError) else getattr(exc, "code", lambda: None)()
        log.warning("fusion stream of request %s failed (%s): drafting goes on elsewhere or stops", request_id,
                    getattr(code, "name", type(exc).__name__))
        if live.fusion is not None:
            if code in (None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN):
                self.fusions.mark_down(live.fusion)
            self.fusions.release(live.fusion)
            live.fusion = None

    async def _reopen_fusion(self, request: Request) -> bool:
        """Open the request at another ready fusion replica with every token it committed (no prompt scoring:
        routing keeps what it learnt). False: none is ready, or the open failed."""
        live: LiveRequest = request.payload
        live.fusion_lost_at = self.clock.now()  # a failed try waits fusion_retry_s again
        fusion = self._pick_fusion()
        if fusion is None:
            return False
        timeout = None if live.timeout_at is None else max(0.1, live.timeout_at - time.monotonic())
        call = fusion_pb2_grpc.FusionStub(fusion.channel).Speculate(timeout=timeout, metadata=live.metadata)
        opening = fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
            request_id=request.request_id, prompt_token_ids=live.prompt + list(request.generated), drafters=live.plan.pool,
            fusion=FUSION_MODE_PROTO[live.plan.switches.fusion], score_prompt=False))
        try:
            await asyncio.wait_for(call.write(opening), self.config.first_draft_deadline_s)
        except asyncio.CancelledError:
            close_quietly(call)
            self.fusions.release(fusion)
            raise
        except Exception:  # noqa: BLE001 - that one failed too: plain decoding
            close_quietly(call)
            self.fusions.mark_down(fusion)
            self.fusions.release(fusion)
            return False
        live.spec_call, live.fusion, live.fusion_fresh, live.fusion_lost_at = call, fusion, True, None
        live.fusion_generation += 1
        self.metrics.fusion_failovers.labels("reopened").inc()
        log.warning("request %s reopened at fusion replica %s", request.request_id, fusion.name)
        return True

    def _lane_of(self, rounds, opens, releases) -> VerifierLane | None:
        """The verifier of a step: the step loop forms every step from one lane's requests."""
        if rounds or opens:
            endpoint = (rounds[0][0] if rounds else opens[0]).payload.verifier
        else:
            name = next((self._opened_on[rid] for rid in releases if rid in self._opened_on), None)
            lane = self.lanes.get(name) if name is not None else None
            return lane
        lane = self.lanes.get(endpoint.name)
        if lane is None:
            lane = self.lanes[endpoint.name] = VerifierLane(endpoint)
        return lane

    async def verify(self, rounds, opens, releases, failovers: int = 2) -> list:
        """One step on the lane's long-lived VerifySteps stream: releases, opens, then every round in one message.
        A broken stream moves the lane's requests to other verifiers (`failovers` times at most; see the module)."""
        lane = self._lane_of(rounds, opens, releases)
        for rid in releases:
            self._opened_on.pop(rid, None)
        if lane is None:
            return [ServiceError(grpc.StatusCode.INTERNAL, "a step without a verifier")] * len(rounds)
        if not rounds and not opens and (lane.call is None or lane.call.done()):
            return []  # releases only, and the stream they were open on is gone: nothing holds them any more
        if lane.call is None or lane.call.done():  # (re)open: requests opened on an old stream are gone
            lane.generation += 1
            lane.call = verifier_pb2_grpc.VerifierStub(lane.endpoint.channel).VerifySteps()
        opening = {r.request_id for r in opens}
        # requests opened on an older stream of this verifier (it restarted): open them again, with what they committed
        opens = list(opens) + [r for r, _ in rounds if r.request_id not in opening and r.payload.stream != lane.generation]
        entries = [verifier_pb2.VerifyEntry(request_id=rid, release=verifier_pb2.VerifyRelease()) for rid in releases]
        for request in opens:
            live: LiveRequest = request.payload
            committed = live.prompt + list(request.generated)
            entries.append(verifier_pb2.VerifyEntry(request_id=request.request_id, open=verifier_pb2.VerifyOpen(
                request_id=request.request_id, committed_token_ids=committed, sampling=live.sampling,
                prompt_len=len(live.prompt))))
            live.stream = lane.generation
            self._opened_on[request.request_id] = lane.endpoint.name
        spans = []
        for request, tree in rounds:
            live = request.payload
            span = self.tracing.start("scheduler.verify", {"cosine.tree_size": len(tree), "cosine.batch_size": len(rounds)},
                                      parent=live.round_span(self.tracing))
            spans.append(span)
            entry = verifier_pb2.VerifyEntry(request_id=request.request_id, round=verifier_pb2.VerifyRound(
                tree=common_pb2.DraftTree(token_ids=tree.tokens, parents=tree.parents, probs=tree.probs),
                steps=request.steps,  # > 1 only for a decode run (steploop: no tree in its step)
                lookup=0 if len(tree) else request.lookup))
            self.tracing.carrier(span, entry.round.trace_context)
            entries.append(entry)
        now = self.clock.now()
        for _ in rounds:
            self.load.enter(now)
        broken = None
        try:
            steps = max([r.steps for r, _ in rounds], default=1)
            reply = await self._step(lane, verifier_pb2.VerifyStep(entries=entries), self._verify_deadline(bool(opens), steps))
        except Exception as exc:  # noqa: BLE001 - the stream broke: fail over, or every round of the step fails with it
            broken = exc
        finally:
            now = self.clock.now()
            for span in spans:
                span.end()
            for _ in rounds:
                self.load.leave(now)
        if broken is not None:
            if failovers <= 0 or not rounds:
                return [broken] * len(rounds)
            return await self._failover(lane, rounds, broken, failovers - 1)
        results = list(reply.results)
        failed_open: dict[str, BaseException] = {}
        for request, result in zip(opens, results[:len(opens)]):
            if result.WhichOneof("kind") == "error":
                failed_open[request.request_id] = _entry_error(result.error)
                if request.payload.resumed and result.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]:
                    # its previous scheduler's stream still holds it at the verifier (that stream is going away)
                    failed_open[request.request_id] = Handover("the request's previous scheduler still holds it; resume it again")
        out: list = []
        for (request, _), result in zip(rounds, results[len(opens):]):
            if request.request_id in failed_open:
                out.append(failed_open[request.request_id])
            elif request.payload.stream != lane.generation:
                out.append(ServiceError(grpc.StatusCode.UNAVAILABLE, "the verifier restarted while the request ran: retry it"))
            elif result.WhichOneof("kind") == "error":
                out.append(_entry_error(result.error))
            else:
                v = result.verdict
                out.append(Verdict(list(v.token_ids), v.accepted_draft, v.verify_ms / 1000, v.lookup_drafted, v.lookup_accepted))
        out += [ServiceError(grpc.StatusCode.INTERNAL, "the verifier answered fewer rounds than it was sent")] * (len(rounds) - len(out))
        return out

    async def _step(self, lane: VerifierLane, message: verifier_pb2.VerifyStep, deadline: float) -> verifier_pb2.VerifyStepResult:
        call = lane.call
        try:
            async with lane.lock:
                try:
                    return await asyncio.wait_for(exchange(call, message, "verifier"), deadline)
                except asyncio.TimeoutError:  # hung (stopped, wedged): taken for dead, as a broken stream is
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                                       f"the verifier did not answer within {deadline:.1f} s; retry the request") from None
        except BaseException as exc:
            if lane.call is not call:  # broken (and handled) while this step waited for the lock
                raise
            close_quietly(lane.call)  # the verifier frees what the stream held; requests on it fail
            lane.call = None
            lane.generation += 1
            if not isinstance(exc, asyncio.CancelledError):
                self.verifiers.mark_down(lane.endpoint)  # no new requests there until its health check passes
            raise

    def _verify_deadline(self, opening: bool, steps: int = 1) -> float:
        """Seconds a step may take: 10 × the measured step time (× the steps of a decode run), at least
        verify_deadline_s (open_deadline_s when it opens requests: the verifier prefills their prompts first)."""
        floor = self.config.open_deadline_s if opening else self.config.verify_deadline_s
        return max(floor, 10 * steps * (self.loop.step_estimate or 0.0))

    def _move(self, request: Request, target: Endpoint) -> None:
        """Place a request on another verifier (picked for it): it opens there with its next step."""
        live: LiveRequest = request.payload
        self.verifiers.release(live.verifier)
        live.verifier = target
        request.lane = target.name
        request.opened = False
        self._opened_on.pop(request.request_id, None)
        self.metrics.failovers.inc()

    async def _failover(self, lane: VerifierLane, rounds, broken: BaseException, failovers: int) -> list:
        """The lane's stream broke during a step: move every request open on it to other ready verifiers, verify
        this step's rounds again there now (opening them with their committed tokens), and return their results."""
        gone = lane.endpoint
        in_step = {r.request_id for r, _ in rounds}
        others = frozenset({gone})
        try:
            for request in list(self.loop.requests.values()):  # not in this step: they reopen with their next round
                if request.request_id not in in_step and request.payload.verifier is gone:
                    self._move(request, self.verifiers.pick(exclude=others))
            groups: dict[str, list] = {}
            for request, tree in rounds:
                self._move(request, self.verifiers.pick(exclude=others))
                groups.setdefault(request.lane, []).append((request, tree))
        except ServiceError as none:  # no other verifier is ready: the step fails as the stream did
            log.warning("verifier stream broke and no other verifier is ready: %d rounds fail", len(rounds))
            return [none] * len(rounds)
        log.warning("verifier stream broke (%s): %d requests of the step move to %s", type(broken).__name__, len(rounds),
                    sorted(groups))
        for group in groups.values():
            for request, _ in group:
                request.opened = True  # opened by the replay below
        outcomes = await asyncio.gather(*(self.verify(group, [r for r, _ in group], [], failovers) for group in groups.values()))
        results = {r.request_id: result for group, out in zip(groups.values(), outcomes) for (r, _), result in zip(group, out)}
        return [results[r.request_id] for r, _ in rounds]

    async def commit(self, rounds) -> list:
        spans = [self.tracing.start("scheduler.commit", {"cosine.committed_tokens": len(tokens)},
                                    parent=request.payload.round_span(self.tracing)) for request, tokens, _, _ in rounds]
        try:
            return await self.store.commit_many([(request.request_id, request.step, tokens, drafted, accepted,
                                                  request.payload.plan.state(), request.payload.epoch)
                                                 for request, tokens, drafted, accepted in rounds])
        except Exception as exc:  # noqa: BLE001 - Redis is gone: every round of the step fails with it
            return [exc] * len(rounds)
        finally:
            for span in spans:
                span.end()

    def emit(self, request: Request, emission: Emission) -> None:
        request.payload.queue.put_nowait(emission)

    def learn(self, request: Request, record: RoundRecord) -> None:
        live: LiveRequest = request.payload
        plan, verdict, draft = live.plan, record.verdict, record.draft
        reply = draft.payload if draft is not None else None
        tree = record.tree
        drafted, committed = len(tree), len(record.committed)
        accepted = min(verdict.accepted_draft, committed)
        chain = tree_depth(tree.parents)
        depth = record.order.depth if record.order is not None else 0
        drafters = draft.drafters if draft is not None else []
        draft_compute = draft.compute_s if draft is not None else 0.0
        span = live.round_span(self.tracing)
        if span.is_recording():
            span.set_attributes({"cosine.round": request.rounds - 1, "cosine.depth": depth, "cosine.drafters": len(drafters),
                                 "cosine.tree_size": drafted, "cosine.accepted_length": accepted,
                                 "cosine.committed_tokens": committed, "cosine.batch_size": record.batch_size})
        live.end_round()
        if self.gate is not None:
            self.gate.observe(committed)
        if record.steps > 1 and plan.depth is not None:
            plan.depth.count_plain(record.steps - 1)
        self._learn(plan, reply, depth if reply is not None else 0, len(drafters), chain, min(verdict.accepted_draft, chain),
                    list(verdict.token_ids), draft_compute, verdict.compute_s, drafted, record.round_s, record.steps)
        self._observe(drafted, accepted, committed, record.draft_s, record.verify_s, record.commit_s, draft_compute,
                      verdict.compute_s)
        self._observe_speculation(depth if drafted else 0, drafters, chain, accepted)
        self._control()

    def observe_ahead(self, request: Request, draft: Draft | None, order: RoundOrder, used: bool) -> None:
        live: LiveRequest = request.payload
        if draft is not None and draft.payload is not None:
            self.costs.observe_draft(order.depth, draft.compute_s,
                                     (live.plan.switches.fusion, len(draft.payload.proposals) or 1))
        self.metrics.ahead.labels("used" if used else "discarded").inc()

    def _on_step(self, size: int, seconds: float) -> None:
        self.metrics.step_size.observe(size)
        self.metrics.step_seconds.observe(seconds)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self.loop.close()
        for lane in self.lanes.values():
            close_quietly(lane.call)

    def _learn(self, plan: RequestPlan, reply, depth, n_drafters, chain, accepted, target_tokens, draft_s, verify_s, nodes,
               round_s, steps: int = 1) -> None:
        """Feed one verified round to the cost model, the request's acceptance estimate and its routing scores
        (a decode run of `steps` plain steps counts as that many steps, and its round trip once per step)."""
        if depth > 0 and reply is not None:
            self.costs.observe_draft(depth, draft_s, (plan.switches.fusion, n_drafters))
        self.costs.observe_verify(nodes, verify_s / steps)
        self.costs.observe_overhead((round_s - draft_s - verify_s) / steps)
        if plan.depth is not None and chain > 0:
            plan.depth.speculation.observe(chain, accepted)
        if plan.router is not None and reply is not None:
            fused = list(reply.fused_token_ids) or None
            drafts = {p.drafter: (list(p.token_ids), list(p.probs)) for p in reply.proposals if p.drafter in plan.router.evidence}
            plan.router.observe_round(drafts, target_tokens, accepted, context=fused)

    def _prior(self, router: ExpertiseRouter, fits) -> None:
        for f in fits:
            if f.drafter in router.evidence:
                router.prior(f.drafter, PromptFit(f.positions, f.hits, f.confidence_sum, f.logprob_sum if f.has_logprob else None))
        first = router.select()
        for name in first:
            self.metrics.first_choice.labels(name).inc()

    def _observe_speculation(self, depth, drafters, chain, accepted) -> None:
        m = self.metrics
        m.depth.observe(depth)
        for name in drafters if depth > 0 else ():  # the drafters that drafted this round
            m.routed.labels(name).inc()
        for position in range(chain):
            m.position_drafted.labels(str(position)).inc()
            if position < accepted:
                m.position_accepted.labels(str(position)).inc()

    def _observe(self, drafted, accepted, committed, draft_s, verify_s, commit_s, draft_compute_s, verify_compute_s):
        m = self.metrics
        m.rounds.inc()
        m.drafted.inc(drafted)
        m.accepted.inc(accepted)
        m.accepted_len.observe(committed)
        if draft_s > 0 and draft_compute_s > 0:
            m.draft_seconds.observe(draft_s)
            m.draft_compute_seconds.observe(draft_compute_s)
        m.verify_seconds.observe(verify_s)
        m.verify_compute_seconds.observe(verify_compute_s)
        m.commit_seconds.observe(commit_s)
