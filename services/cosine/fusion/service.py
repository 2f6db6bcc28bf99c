"""gRPC adapter of fusion: one Speculate stream per request, driving that request's drafters.

Each drafter may have several replicas (an `EndpointPool` per drafter): a request's stream to a drafter
opens on the least-loaded ready replica and stays there (its KV cache lives there); a replica whose
stream breaks is marked down in its pool, so new requests go to the others, while `health.py` goes on
judging the drafter as a whole."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Counter, Gauge

from cosine.common.convert import fusion_mode_name
from cosine.common.errors import ServiceError, invalid
from cosine.common.pool import Endpoint, EndpointPool
from cosine.common.streams import close_quietly, exchange
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from cosine.engine.tree import DraftTree
from cosine.fusion.calibration import CalibrationTable
from cosine.fusion.confidence import ConfidenceFusion, merge_only, single_chain
from cosine.fusion.health import HealthConfig, HealthView
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc

log = logging.getLogger(__name__)


class FusionMetrics:
    """Acceptance by drafter: a drafter's chain of round k is compared with the tokens the
    target accepted, which arrive as round k+1's committed tokens (so a request's last
    round is not counted). Labels: drafter names of the deployment, a bounded set."""

    def __init__(self, registry=None):
        self._exported: set[str] = set()
        self.proposed = Counter("cosine_fusion_drafter_proposed_tokens_total", "tokens each drafter proposed", ["drafter"], registry=registry)
        self.accepted = Counter(
            "cosine_fusion_drafter_accepted_tokens_total", "proposed tokens on the path the target accepted", ["drafter"], registry=registry)
        self.fused = Counter(
            "cosine_fusion_fused_tokens_total", "confidence fusion: fused-chain tokens each drafter won", ["drafter"], registry=registry)
        self.rounds = Counter("cosine_fusion_rounds_total", "rounds drafted, by fusion mode", ["mode"], registry=registry)
        self.dropped = Counter("cosine_fusion_drafter_dropped_total",
                               "drafters dropped from a request (the request goes on without them), by reason: failed, timeout, full",
                               ["drafter", "reason"], registry=registry)
        self.skipped = Counter("cosine_fusion_drafter_skipped_total",
                               "times a drafter was taken out of use for new requests after repeated failures", ["drafter"], registry=registry)
        self.calibration_error = Gauge(
            "cosine_fusion_drafter_calibration_error",
            "expected calibration error of each drafter's probabilities against acceptance, as the drafter states them "
            "(stated) and as fusion used them after calibration (used)", ["drafter", "probabilities"], registry=registry)
        self.calibration_observed = Gauge("cosine_fusion_drafter_calibration_observations",
                                          "drafted positions judged for calibration (halved per bin past its cap)",
                                          ["drafter"], registry=registry)

    def export_calibration(self, table: CalibrationTable) -> None:
        """Gauges that read the calibration table when scraped (drafters get theirs on first sight)."""
        for name, cal in table.drafters.items():
            if name in self._exported:
                continue
            self._exported.add(name)
            self.calibration_error.labels(name, "stated").set_function(lambda c=cal: c.raw.ece() or 0.0)
            self.calibration_error.labels(name, "used").set_function(lambda c=cal: c.mapped.ece() or 0.0)
            self.calibration_observed.labels(name).set_function(lambda c=cal: c.raw.total)

    def judge(self, chains: dict[str, list[int]], committed: list[int], context: list[int] | None = None) -> None:
        """committed: accepted drafts then the target's own token, so at most len - 1 are drafts.

        ``context``: the chain the drafters continued from (confidence fusion's fused chain), None
        when each drafted on its own. A token counts as accepted when it equals the target's and
        the drafter's context up to it was accepted too."""
        accepted_path = committed[:-1]
        for name, chain in chains.items():
            ctx = chain if context is None else context
            agreed = 0
            for i, (proposed, taken) in enumerate(zip(chain, accepted_path)):
                if i > 0 and (i - 1 >= len(ctx) or ctx[i - 1] != accepted_path[i - 1]):
                    break
                agreed += proposed == taken
            self.proposed.labels(name).inc(len(chain))
            self.accepted.labels(name).inc(agreed)


class _Request:
    """One Speculate stream: the drafters it may use, their streams (opened on first use), and the
    committed tokens each has not been sent yet.

    ``names``: the drafters the open named (rounds may name only these); ``pending`` holds the ones
    still in use: a drafter that failed, hung or was full is dropped from it for good."""

    def __init__(self, open_msg, names: list[str], mode: str, usable: list[str] | None = None):
        self.request_id = open_msg.request_id
        self.prompt = list(open_msg.prompt_token_ids)
        self.names = names
        self.mode = mode
        self.calls: dict[str, grpc.aio.StreamStreamCall] = {}
        self.replicas: dict[str, Endpoint] = {}  # the replica of each drafter its stream is open on
        self.pending: dict[str, list[int]] = {n: [] for n in (names if usable is None else usable)}
        # the previous round's proposals (tokens, stated probabilities) and their context, judged when its outcome arrives
        self.chains: dict[str, tuple[list[int], list[float]]] = {}
        self.context: list[int] | None = None
        self.metadata = None

    def take(self, name: str) -> list[int]:
        committed, self.pending[name] = self.pending[name], []
        return committed

    def active(self, names: list[str]) -> list[str]:
        """Those of `names` still in use, in order."""
        return [n for n in names if n in self.pending]

    def drop(self, name: str) -> None:
        self.pending.pop(name, None)
        close_quietly(self.calls.pop(name, None))


class FusionServicer(fusion_pb2_grpc.FusionServicer):
    """``top_k``: candidates per drafter and step in confidence fusion (side branches of the tree).
    ``health``: deadlines and skipping of failing drafters (see health.py); ``probe_timeout_s``: how
    long the health check of a skipped drafter may take."""

    def __init__(self, drafters: dict[str, EndpointPool], metrics: FusionMetrics | None = None,
                 tracing: Tracing | None = None, top_k: int = 3, health: HealthConfig | None = None,
                 probe_timeout_s: float = 2.0, clock=time.monotonic, calibration: CalibrationTable | None = None):
        self.drafters = drafters
        self.calibration = calibration or CalibrationTable()
        self.metrics = metrics or FusionMetrics()
        self.tracing = tracing or Tracing("fusion")
        self.top_k = top_k
        self.health = HealthView(list(drafters), health or HealthConfig())
        self.probe_timeout_s = probe_timeout_s
        self.clock = clock
        self._infos: dict[str, common_pb2.ModelInfo] = {}  # each drafter's last answer to Info
        self._asked: set[str] = set()  # drafters ListDrafters asked before
        self._probes: set[asyncio.Task] = set()

    async def ListDrafters(self, request, context):
        """Every drafter of this node. One that does not answer now is listed with what it said last
        (or its name alone): a dead drafter must not make requests that name it invalid."""
        self._start_probes()

        remaining = context.time_remaining()

        async def one(name, pool: EndpointPool):
            known = self._infos.get(name)
            patient = name not in self._asked  # the first time, a drafter may still be starting: wait for it a while
            self._asked.add(name)
            timeout = 10.0 if patient else self.probe_timeout_s
            if remaining is not None:
                timeout = max(0.1, min(timeout, 0.8 * remaining))  # answer within the caller's deadline
            try:
                replica = await pool.wait_ready(timeout) if patient else pool.pick(place=False)
                info = await drafter_pb2_grpc.DrafterStub(replica.channel).Info(
                    common_pb2.InfoRequest(), timeout=timeout, wait_for_ready=patient, metadata=self.tracing.metadata())
            except ServiceError:
                log.warning("drafter %s has no ready replica", name)
                return known or common_pb2.ModelInfo(name=name)
            except grpc.RpcError as exc:
                log.warning("drafter %s did not answer Info: %s", name, exc.code() if isinstance(exc, grpc.aio.AioRpcError) else exc)
                return known or common_pb2.ModelInfo(name=name)
            self._infos[name] = info
            return info
        infos = await asyncio.gather(*(one(n, stub) for n, stub in self.drafters.items()))
        return fusion_pb2.DrafterList(drafters=infos)

    def _start_probes(self) -> None:
        """Health-check each skipped drafter whose backoff is over (in the background: nobody waits on it)."""
        for name in self.health.probes_due(self.clock()):
            task = asyncio.get_running_loop().create_task(self._probe(name))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, name: str) -> None:
        try:
            replica = self.drafters[name].pick(place=False)
            self._infos[name] = await drafter_pb2_grpc.DrafterStub(replica.channel).Info(
                common_pb2.InfoRequest(), timeout=self.probe_timeout_s)
            ok = True
        except (grpc.RpcError, ServiceError):
            ok = False
        self.health.probe_result(name, ok, self.clock())
        if ok:
            log.info("drafter %s passed its health check: new requests use it again", name)
        else:
            log.info("drafter %s failed its health check: still skipped", name)

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        req: _Request | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    if req is not None:
                        raise invalid("Speculate stream opened twice")
                    req = self._open(message.open)
                    if message.open.score_prompt:
                        yield fusion_pb2.SpeculateResponse(prompt_fits=await self._score(req, context))
                elif kind == "round":
                    if req is None:
                        raise invalid("Speculate round before open")
                    committed = list(message.round.committed_token_ids)
                    if req.chains:
                        self.metrics.judge({n: tokens for n, (tokens, _) in req.chains.items()}, committed, req.context)
                        self.calibration.observe_round(req.chains, committed, req.context)
                        self.metrics.export_calibration(self.calibration)
                    for pending in req.pending.values():
                        pending.extend(committed)
                    yield await self._round(req, message.round, context)
                else:
                    raise invalid("Speculate message has neither open nor round")
        finally:
            if req is not None:
                for call in req.calls.values():
                    close_quietly(call)
                for name in list(req.replicas):
                    self._release(req, name)

    def _release(self, req: _Request, name: str) -> None:
        replica = req.replicas.pop(name, None)
        if replica is not None:
            self.drafters[name].release(replica)

    def _open(self, open_msg) -> _Request:
        names = list(dict.fromkeys(open_msg.drafters))
        if not names:
            raise invalid("Speculate open names no drafter")
        unknown = [n for n in names if n not in self.drafters]
        if unknown:
            raise invalid(f"unknown drafter(s) {unknown}; this fusion node has {sorted(self.drafters)}")
        try:
            mode = fusion_mode_name(open_msg.fusion, unspecified="merge")  # unspecified: prefix-merge, the plainest
        except ValueError as exc:
            raise invalid(str(exc)) from None
        self._start_probes()
        # drafters out of use after repeated failures are left out: the request drafts with the rest, or not at all
        req = _Request(open_msg, names, mode, [n for n in names if self.health.usable(n)])
        req.metadata = self.tracing.metadata()  # drafter streams opened later are children of this Speculate call
        return req

    def _open_call(self, req: _Request, name: str, context) -> grpc.aio.StreamStreamCall:
        """The request's stream to the drafter, on the least-loaded ready replica (ServiceError UNAVAILABLE: none)."""
        replica = req.replicas[name] = self.drafters[name].pick()
        call = drafter_pb2_grpc.DrafterStub(replica.channel).Draft(timeout=context.time_remaining(), metadata=req.metadata)
        req.calls[name] = call
        return call

    def _open_message(self, req: _Request, score_prompt: bool = False) -> drafter_pb2.DraftRequest:
        return drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(
            request_id=req.request_id, prompt_token_ids=req.prompt, score_prompt=score_prompt))

    async def _call(self, req: _Request, name: str, context) -> grpc.aio.StreamStreamCall:
        call = req.calls.get(name)
        if call is None:
            call = self._open_call(req, name, context)
            await call.write(self._open_message(req))
        return call

    async def _ask(self, req: _Request, names: list[str], send, positions: int) -> dict:
        """``send(name)`` to each drafter together, each within its deadline; returns the replies of
        those that answered. A drafter that failed, timed out or was full is dropped from the request."""
        async def one(name):
            first = name not in req.calls  # its first call also prefills the prompt
            started = self.clock()
            try:
                reply = await asyncio.wait_for(send(name), self.health.deadline(name, positions, first))
            except (asyncio.TimeoutError, ServiceError, grpc.RpcError, asyncio.InvalidStateError) as exc:
                self._drop(req, name, exc)
                return None
            self.health.success(name, None if first else self.clock() - started, positions)
            return reply
        replies = await asyncio.gather(*(one(n) for n in names))
        return {n: r for n, r in zip(names, replies) if r is not None}

    def _drop(self, req: _Request, name: str, exc: BaseException) -> None:
        code = exc.code if isinstance(exc, ServiceError) else exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        if isinstance(exc, asyncio.TimeoutError):
            reason = "timeout"
        elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            reason = "full"  # alive, only busy: its health does not change
        else:
            reason = "failed"
        replica, pool = req.replicas.get(name), self.drafters[name]
        replica_down = (reason == "failed" and replica is not None
                        and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN))
        if replica_down:
            pool.mark_down(replica)  # its stream broke: new requests go to the drafter's other replicas
        req.drop(name)
        self._release(req, name)
        self.metrics.dropped.labels(name, reason).inc()
        log.warning("request %s goes on without drafter %s (%s: %s)", req.request_id, name, reason,
                    getattr(exc, "message", None) or (exc.details() if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__))
        # one replica gone while another is ready is not the drafter failing: new requests go to that one
        if reason != "full" and not (replica_down and any(e.healthy for e in pool.endpoints())) \
                and self.health.failure(name, self.clock()):
            self.metrics.skipped.labels(name).inc()
            log.warning("drafter %s failed %d times in a row: new requests skip it until it passes a health check",
                        name, self.health.config.failures_to_skip)

    async def _score(self, req: _Request, context) -> list:
        """Open every drafter of the request now; each prefills the prompt and reports how well it predicted it."""
        async def one(name):
            call = self._open_call(req, name, context)
            reply = await exchange(call, self._open_message(req, score_prompt=True), f"drafter {name}")
            return reply.prompt_fit
        # the open is each drafter's first call (the deadline allows for the prefill) and opens its stream
        names = req.active(req.names)
        fits = await self._ask(req, names, lambda n: one(n), 0) if names else {}
        return list(fits.values())

    async def _exchange(self, req: _Request, names: list[str], steps: dict[str, drafter_pb2.DraftStep], context,
                        positions: int) -> dict:
        async def one(name):
            call = await self._call(req, name, context)
            return await exchange(call, drafter_pb2.DraftRequest(step=steps[name]), f"drafter {name}")
        return await self._ask(req, names, one, positions)

    async def _round(self, req: _Request, round_msg, context) -> fusion_pb2.SpeculateResponse:
        started = time.perf_counter()
        names = list(dict.fromkeys(round_msg.drafters)) or req.names
        outside = [n for n in names if n not in req.names]
        if outside:
            raise invalid(f"round names drafter(s) {outside} the open did not: {req.names}")
        if req.mode == "single":  # one drafter: the one named, else (dropped) the first of the request's still in use
            names = (req.active(names) or req.active(req.names))[:1]
        else:
            names = req.active(names)  # dropped drafters are left out: an empty list drafts nothing (plain decoding)
        depth = round_msg.depth
        budget = round_msg.budget or max(depth, 1) * max(len(names), 1)
        ahead = list(round_msg.context_token_ids)  # drafting ahead: continue from these uncommitted tokens
        with self.tracing.span("fusion.round", {"cosine.depth": depth, "cosine.drafters": len(names), "cosine.fusion": req.mode},
                               parent=round_msg.trace_context) as span:
            trace: dict[str, str] = {}
            self.tracing.inject(trace)
            if req.mode == "confidence":
                tree, chains, fused, steps = await self._confidence(req, names, depth, budget, trace, context, ahead)
                span.set_attribute("cosine.steps", steps)
            else:
                steps = {n: drafter_pb2.DraftStep(committed_token_ids=req.take(n), depth=depth, context_token_ids=ahead,
                                                  trace_context=trace) for n in names}
                replies = await self._exchange(req, names, steps, context, depth) if names else {}
                chains = {n: (list(r.token_ids), list(r.probs)) for n, r in replies.items()}
                used = {n: (tokens, self.calibration.map_all(n, probs)) for n, (tokens, probs) in chains.items()}
                fused = None
                if not chains:
                    tree = DraftTree()
                elif req.mode == "single":
                    tree = single_chain(*used[names[0]], budget)
                else:
                    tree = merge_only(used, budget)
            span.set_attribute("cosine.tree_size", len(tree.tokens))
        self.metrics.rounds.labels(req.mode).inc()
        # judged when the next round's committed tokens arrive; a round drafted ahead is judged by the scheduler
        req.chains = {} if ahead else chains
        req.context = fused
        return fusion_pb2.SpeculateResponse(
            tree=common_pb2.DraftTree(token_ids=tree.tokens, parents=tree.parents, probs=tree.probs),
            draft_ms=(time.perf_counter() - started) * 1000,
            proposals=[fusion_pb2.DrafterProposal(drafter=n, token_ids=t, probs=p) for n, (t, p) in chains.items()],
            fused_token_ids=fused or [],
        )

    async def _confidence(self, req: _Request, names: list[str], depth: int, budget: int, trace, context, ahead=()):
        """Step-wise fusion: each step every drafter proposes top-k candidates after the fused chain;
        the most confident wins and becomes the context of the next step."""
        fusion = ConfidenceFusion(depth, budget, order=names)
        chains: dict[str, tuple[list[int], list[float]]] = {n: ([], []) for n in names}
        ended: set[str] = set()  # drafters that proposed nothing at some step: their chain ends there
        first = True
        asked = 0  # steps the drafters were asked for
        while not fusion.done:
            live = req.active(names)  # a drafter dropped at some step proposes no more; its chain so far stays
            if not live:
                break
            asked += 1
            steps = {n: drafter_pb2.DraftStep(committed_token_ids=req.take(n) if first else [], depth=1, top_k=self.top_k,
                                              context_token_ids=list(ahead) + fusion.chain, trace_context=trace) for n in live}
            first = False
            replies = await self._exchange(req, live, steps, context, 1)
            candidates = {}
            for n, r in replies.items():
                cands = list(zip(r.candidates[0].token_ids, r.candidates[0].probs)) if r.candidates else []
                candidates[n] = [(t, self.calibration.map(n, p)) for t, p in cands]  # ranked by calibrated confidence
                if cands and n not in ended:
                    chains[n][0].append(cands[0][0])
                    chains[n][1].append(cands[0][1])  # as stated: what calibration learns from
                elif not cands:
                    ended.add(n)
            if fusion.step(candidates) is None:
                break
            self.metrics.fused.labels(fusion.steps[-1].source).inc()
        return fusion.tree(), chains, fusion.chain, asked
