"""gRPC adapter of the scheduler: runs each submitted request's rounds draft → verify → commit."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram

from cosine.common.errors import ServiceError, invalid
from cosine.common.metrics import LATENCY_BUCKETS
from cosine.common.state import RequestStore
from cosine.common.streams import close_quietly, exchange
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc
from cosine.scheduler import policy
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


@dataclass
class SchedulerConfig:
    default_depth: int = 4
    max_depth: int = 16
    max_context: int = 8192


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
        spec = request.speculation
        drafters = list(spec.drafters)
        speculate = not spec.disabled and bool(drafters)
        depth = spec.max_depth if spec.HasField("max_depth") else self.config.default_depth
        depth = min(depth, self.config.max_depth) if speculate else 0
        sampling = request.sampling
        created = await self.store.create(
            rid,
            prompt,
            {"temperature": sampling.temperature, "top_p": sampling.top_p if sampling.HasField("top_p") else 1.0,
             "top_k": sampling.top_k, "seed": sampling.seed},
            {"max_new_tokens": request.max_new_tokens, "drafters": drafters, "depth": depth,
             "stop_token_ids": list(request.stop_token_ids)},
        )
        if not created:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already running")
        self.live.add(rid)
        status, reason = "failed", ""
        timeout = context.time_remaining()
        metadata = self.tracing.metadata()  # the streams' server spans are children of this Submit
        verify_call = self.verifier.Verify(timeout=timeout, metadata=metadata)
        spec_call = self.fusion.Speculate(timeout=timeout, metadata=metadata) if speculate else None
        try:
            await verify_call.write(verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
                request_id=rid, committed_token_ids=prompt, sampling=sampling, prompt_len=len(prompt))))
            if spec_call is not None:
                await spec_call.write(fusion_pb2.SpeculateRequest(open=fusion_pb2.SpeculateOpen(
                    request_id=rid, prompt_token_ids=prompt, drafters=drafters)))
            async for response in self._rounds(request, rid, prompt, depth, verify_call, spec_call):
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

    async def _rounds(self, request, rid, prompt, depth, verify_call, spec_call):
        stop_ids = set(request.stop_token_ids)
        max_new = request.max_new_tokens
        generated: list[int] = []
        new: list[int] = []
        stats = common_pb2.Stats(drafters=list(request.speculation.drafters) if spec_call is not None else [])
        step = 0
        while True:
            context_used = len(prompt) + len(generated)
            d = policy.round_depth(depth, len(generated), max_new, context_used, self.config.max_context)
            with self.tracing.span("scheduler.round", {"cosine.round": step, "cosine.depth": d}) as round_span:
                tree = common_pb2.DraftTree()
                draft_ms = 0.0
                t0 = time.perf_counter()
                if spec_call is not None and d > 0:
                    with self.tracing.span("scheduler.draft", {"cosine.depth": d}):
                        message = fusion_pb2.SpeculateRequest(round=fusion_pb2.SpeculateRound(committed_token_ids=new, depth=d))
                        self.tracing.inject(message.round.trace_context)
                        reply = await exchange(spec_call, message, "fusion")
                    tree, draft_ms = reply.tree, reply.draft_ms
                    new = []  # fusion has them now; rounds without drafting pass theirs on later
                t1 = time.perf_counter()
                with self.tracing.span("scheduler.verify", {"cosine.tree_size": len(tree.token_ids)}):
                    message = verifier_pb2.VerifyRequest(round=verifier_pb2.VerifyRound(tree=tree))
                    self.tracing.inject(message.round.trace_context)
                    verdict = await exchange(verify_call, message, "verifier")
                t2 = time.perf_counter()
                cut = policy.cut_round(list(verdict.token_ids), len(generated), max_new, stop_ids, context_used, self.config.max_context)
                accepted = min(verdict.accepted_draft, len(cut.token_ids))
                drafted = len(tree.token_ids)
                with self.tracing.span("scheduler.commit", {"cosine.committed_tokens": len(cut.token_ids)}):
                    step = await self.store.commit(rid, step, cut.token_ids, drafted, accepted)
                t3 = time.perf_counter()
                if round_span.is_recording():
                    round_span.set_attributes({"cosine.drafters": len(stats.drafters), "cosine.tree_size": drafted,
                                               "cosine.accepted_length": accepted, "cosine.committed_tokens": len(cut.token_ids)})
            generated += cut.token_ids
            new += cut.token_ids
            stats.rounds += 1
            stats.drafted_tokens += drafted
            stats.accepted_tokens += accepted
            self._observe(drafted, accepted, len(cut.token_ids), t1 - t0, t2 - t1, t3 - t2, draft_ms / 1000, verdict.verify_ms / 1000)
            yield scheduler_pb2.SubmitResponse(request_id=rid, tokens=scheduler_pb2.CommittedTokens(
                token_ids=cut.token_ids, drafted_tokens=drafted, accepted_tokens=accepted))
            if cut.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield scheduler_pb2.SubmitResponse(request_id=rid, final=scheduler_pb2.SubmitFinal(
                    finish_reason=cut.finish_reason, stats=stats))
                return

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
