"""gRPC adapter of the scheduler: runs each submitted request's rounds draft → verify → commit."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field

import grpc
from prometheus_client import Counter, Gauge, Histogram

from cosine.common.errors import ServiceError, invalid
from cosine.common.metrics import LATENCY_BUCKETS
from cosine.common.state import RequestStore
from cosine.common.streams import close_quietly, exchange
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc
from cosine.router.routing import ExpertiseRouter, PromptFit
from cosine.scheduler import policy
from cosine.engine.tree import DraftTree
from cosine.scheduler.adaptive import CostModel, DepthChooser, LoadMeter
from cosine.scheduler.ahead import main_chain_tokens, subtree_after
from cosine.scheduler.speculation import RequestSpeculation, SpeculationController
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


FUSION_MODES = {"confidence": common_pb2.FUSION_MODE_CONFIDENCE, "merge": common_pb2.FUSION_MODE_MERGE,
                "single": common_pb2.FUSION_MODE_SINGLE}


def request_switches(server: Switches, spec: common_pb2.SpeculationParams) -> Switches:
    """The server's switches with the request's own (unset fields keep the server's)."""
    changes = {}
    if spec.fusion != common_pb2.FUSION_MODE_UNSPECIFIED:
        changes["fusion"] = {v: k for k, v in FUSION_MODES.items()}[spec.fusion]
    if spec.HasField("routing"):
        changes["routing"] = spec.routing
    if spec.HasField("adaptive_depth"):
        changes["adaptive_depth"] = spec.adaptive_depth
    if spec.HasField("pipelining"):
        changes["pipelining"] = spec.pipelining
    return server.replace(**changes) if changes else server


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


def tree_depth(parents) -> int:
    """Longest root-to-leaf path of a draft tree (nodes are in topological order)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        store: RequestStore,
        verifier: verifier_pb2_grpc.VerifierStub,
        fusion: fusion_pb2_grpc.FusionStub,
        config: SchedulerConfig,
        metrics: SchedulerMetrics,
        tracing: Tracing | None = None,
    ):
        self.store = store
        self.verifier = verifier
        self.fusion = fusion
        self.config = config
        self.metrics = metrics
        self.tracing = tracing or Tracing("scheduler")
        self.live: set[str] = set()
        metrics.live.set_function(lambda: len(self.live))
        sw = config.switches
        self.costs = CostModel()
        self.load = LoadMeter(time.monotonic())
        self.controller = SpeculationController(
            max_depth=config.max_depth, max_drafters=max(1, config.routing_max_k),
            depth_cap=min(config.default_depth, config.max_depth), drafters=max(1, min(config.routing_k, config.routing_max_k)),
            queue_high=max(1, config.verifier_queue_high), adaptive=sw.adaptive_depth)
        self._controlled_at = time.monotonic()
        metrics.depth_cap.set_function(lambda: self.controller.depth_cap)
        metrics.drafters_cap.set_function(lambda: self.controller.drafters)

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
        plan = self.plan(request)
        drafters = plan.pool
        sampling = request.sampling
        created = await self.store.create(
            rid,
            prompt,
            {"temperature": sampling.temperature, "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
             "top_k": sampling.top_k, "seed": sampling.seed},
            {"max_new_tokens": request.max_new_tokens, "drafters": drafters, "depth": plan.fixed_depth,
             "stop_token_ids": list(request.stop_token_ids)},
        )
        if not created:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already running")
        self.live.add(rid)
        status, reason = "failed", ""
        timeout = context.time_remaining()
        metadata = self.tracing.metadata()  # the streams' server spans are children of this Submit
        verify_call = self.verifier.Verify(timeout=timeout, metadata=metadata)
        spec_call = self.fusion.Speculate(timeout=timeout, metadata=metadata) if plan.speculate else None
        try:
            await verify_call.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
                request_id=rid, committed_token_ids=prompt, sampling=sampling, prompt_len=len(prompt))))
            if spec_call is not None:
                opening = fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
                    request_id=rid, prompt_token_ids=prompt, drafters=drafters, fusion=FUSION_MODES[plan.switches.fusion],
                    score_prompt=plan.router is not None))
                if plan.router is None:
                    await spec_call.write(opening)
                else:  # routing's prior: every candidate prefills the prompt and says how well it predicted it
                    with self.tracing.span("scheduler.score_prompt", {"cosine.drafters": len(drafters)}):
                        scored = await exchange(spec_call, opening, "fusion")
                    self._prior(plan.router, scored.prompt_fits)
            async for response in self._rounds(request, rid, prompt, plan, verify_call, spec_call):
                if response.WhichOneof("kind") == "final":
                    status, reason = "finished", common_pb2.FinishReason.Name(response.final.finish_reason)
                yield response
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away: cancelled, or closed while we waited at a yield
            status = "cancelled"
            raise
        finally:
            close_quietly(verify_call)
            close_quietly(spec_call)
            self.live.discard(rid)
            try:
                await asyncio.shield(self.store.finish(rid, status, reason))
            except Exception:  # noqa: BLE001 - the TTL set at creation still bounds the state
                log.warning("could not mark request %s %s in Redis", rid, status, exc_info=True)

    def _round_plan(self, plan: RequestPlan, room: int) -> tuple[int, list[str], int]:
        """(depth, drafters, tree budget) of the next round; `room` caps the depth (length, context)."""
        if not plan.speculate or room <= 0:
            return 0, [], 0
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

    def _control(self) -> None:
        """Move the global caps from the verifier's load, at most every control_interval_s."""
        now = time.monotonic()
        if now - self._controlled_at >= self.config.control_interval_s:
            self._controlled_at = now
            idle, queue = self.load.read(now)
            self.controller.update_load(idle, queue)

    async def _rounds(self, request, rid, prompt, plan: RequestPlan, verify_call, spec_call):
        stop_ids = set(request.stop_token_ids)
        max_new = request.max_new_tokens
        generated: list[int] = []
        new: list[int] = []
        stats = common_pb2.Stats()
        step = 0
        ready: DraftTree | None = None  # a tree drafted ahead for the next round
        ready_drafters: list[str] = []
        while True:
            context_used = len(prompt) + len(generated)
            room = policy.round_depth(self.config.max_depth, len(generated), max_new, context_used, self.config.max_context)
            d, drafters, budget = self._round_plan(plan, room) if spec_call is not None else (0, [], 0)
            tree = common_pb2.DraftTree()
            if ready is not None:  # drafted ahead during the previous verification, which went as assumed
                cut_tree = subtree_after(ready, [], room) if room > 0 else None
                if cut_tree is not None and len(cut_tree):
                    tree = common_pb2.DraftTree(token_ids=cut_tree.tokens, parents=cut_tree.parents, probs=cut_tree.probs)
                    d, drafters = tree_depth(cut_tree.parents), ready_drafters
                ready = None
            with self.tracing.span("scheduler.round", {"cosine.round": step, "cosine.depth": d}) as round_span:
                reply = None
                draft_ms = 0.0
                t0 = time.perf_counter()
                if spec_call is not None and d > 0 and not tree.token_ids:
                    with self.tracing.span("scheduler.draft", {"cosine.depth": d, "cosine.drafters": drafters}):
                        message = fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(
                            committed_token_ids=new, depth=d, drafters=drafters, budget=budget))
                        self.tracing.inject(message.round.trace_context)
                        reply = await exchange(spec_call, message, "fusion")
                    tree, draft_ms = reply.tree, reply.draft_ms
                    new = []  # fusion has them now; rounds without drafting pass theirs on later
                    for name in drafters:
                        if name not in stats.drafters:
                            stats.drafters.append(name)
                t1 = time.perf_counter()
                ahead = self._draft_ahead(plan, spec_call, tree, d, drafters, new, len(generated), max_new, context_used)
                if ahead is not None:
                    new = []
                with self.tracing.span("scheduler.verify", {"cosine.tree_size": len(tree.token_ids)}):
                    message = verifier_pb2.VerifyRequest(round=verifier_pb2.VerifyRound(tree=tree))
                    self.tracing.inject(message.round.trace_context)
                    self.load.enter(time.monotonic())
                    try:
                        verdict = await exchange(verify_call, message, "verifier")
                    except BaseException:
                        if ahead is not None:
                            ahead[0].cancel()
                        raise
                    finally:
                        self.load.leave(time.monotonic())
                t2 = time.perf_counter()
                if ahead is not None:
                    ready = await self._ahead_outcome(plan, ahead, verdict)
                    ready_drafters = drafters
                cut = policy.cut_round(list(verdict.token_ids), len(generated), max_new, stop_ids, context_used, self.config.max_context)
                accepted = min(verdict.accepted_draft, len(cut.token_ids))
                drafted = len(tree.token_ids)
                with self.tracing.span("scheduler.commit", {"cosine.committed_tokens": len(cut.token_ids)}):
                    step = await self.store.commit(rid, step, cut.token_ids, drafted, accepted, plan.state())
                t3 = time.perf_counter()
                if round_span.is_recording():
                    round_span.set_attributes({"cosine.drafters": len(drafters), "cosine.tree_size": drafted,
                                               "cosine.accepted_length": accepted, "cosine.committed_tokens": len(cut.token_ids)})
            generated += cut.token_ids
            new += cut.token_ids
            stats.rounds += 1
            stats.drafted_tokens += drafted
            stats.accepted_tokens += accepted
            chain = tree_depth(tree.parents)
            self._learn(plan, reply, d, len(drafters), chain, min(verdict.accepted_draft, chain), list(verdict.token_ids),
                        draft_ms / 1000, verdict.verify_ms / 1000, drafted, t3 - t0)
            self._observe(drafted, accepted, len(cut.token_ids), t1 - t0, t2 - t1, t3 - t2, draft_ms / 1000, verdict.verify_ms / 1000)
            self._observe_speculation(d, drafters, chain, accepted)
            self._control()
            yield scheduler_pb2.SubmitResponse(request_id=rid, tokens=scheduler_pb2.CommittedTokens(
                token_ids=cut.token_ids, drafted_tokens=drafted, accepted_tokens=accepted))
            if cut.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield scheduler_pb2.SubmitResponse(request_id=rid, final=scheduler_pb2.SubmitFinal(
                    finish_reason=cut.finish_reason, stats=stats))
                return

    def _draft_ahead(self, plan: RequestPlan, spec_call, tree, depth, drafters, new, generated, max_new, context_used):
        """Start drafting the next round while this one is verified (pipelining with one request in flight),
        assuming this round's main chain is accepted whole; returns (task, main chain, depth) or None."""
        if spec_call is None or not tree.token_ids or not plan.switches.pipelining or len(self.live) != 1:
            return None
        main = main_chain_tokens(tree.token_ids, tree.parents)
        after = len(main) + 1  # the chain and the bonus token
        room = policy.round_depth(self.config.max_depth, generated + after, max_new, context_used + after, self.config.max_context)
        if room <= 0:
            return None
        ahead_depth = min(max(depth, 1), room) + 1  # the first level guesses the bonus token
        costs = self.costs.costs((plan.switches.fusion, len(drafters)))
        if costs is not None and costs.draft_overhead_s + costs.draft_step_s * ahead_depth > \
                costs.verify_s + costs.verify_per_token_s * len(tree.token_ids):
            return None  # it would not hide behind the verification: the request would wait for it
        message = fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(
            committed_token_ids=new, depth=ahead_depth, drafters=drafters, context_token_ids=main))
        self.tracing.inject(message.round.trace_context)
        return asyncio.create_task(exchange(spec_call, message, "fusion")), main, ahead_depth

    async def _ahead_outcome(self, plan: RequestPlan, ahead, verdict) -> DraftTree | None:
        """The part of the tree drafted ahead that fits what the verifier accepted, or None."""
        task, main, ahead_depth = ahead
        reply = await task  # the stream to fusion is in order: the next round waits for this reply anyway
        self.costs.observe_draft(ahead_depth, reply.draft_ms / 1000, (plan.switches.fusion, len(reply.proposals) or 1))
        tokens = list(verdict.token_ids)
        sub = None
        if verdict.accepted_draft == len(main) and len(tokens) == len(main) + 1 and tokens[:-1] == main:
            drafted = DraftTree(list(reply.tree.token_ids), list(reply.tree.parents), list(reply.tree.probs))
            sub = subtree_after(drafted, tokens[-1:])
        used = sub is not None and len(sub) > 0
        self.metrics.ahead.labels("used" if used else "discarded").inc()
        return sub if used else None

    def _learn(self, plan: RequestPlan, reply, depth, n_drafters, chain, accepted, target_tokens, draft_s, verify_s, nodes,
               round_s) -> None:
        """Feed one verified round to the cost model, the request's acceptance estimate and its routing scores."""
        if depth > 0 and reply is not None:
            self.costs.observe_draft(depth, draft_s, (plan.switches.fusion, n_drafters))
        self.costs.observe_verify(nodes, verify_s)
        self.costs.observe_overhead(round_s - draft_s - verify_s)
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
