"""gRPC adapter of the router: the public Generate stream."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

import grpc
from prometheus_client import Counter, Gauge, Histogram

from cosine.common.errors import ServiceError, broken_stream
from cosine.common.metrics import LATENCY_BUCKETS
from cosine.common.pool import Endpoint, EndpointPool
from cosine.common.tracing import Tracing, set_span_attributes
from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2_grpc
from cosine.router import policy
from cosine.router.detok import StreamText
from cosine.router.v1 import router_pb2, router_pb2_grpc
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self, registry):
        self.requests = Counter("cosine_router_requests_total", "Generate calls by outcome", ["outcome"], registry=registry)
        self.ttft = Histogram("cosine_router_time_to_first_token_seconds", "time to the first text chunk", buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(
            "cosine_router_time_per_output_token_seconds", "mean time per output token after the first, per request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1), registry=registry,
        )
        self.tokens = Counter("cosine_router_output_tokens_total", "tokens streamed to clients", registry=registry)
        self.in_flight = Gauge("cosine_router_requests_in_flight", "Generate streams in progress", registry=registry)
        self.resumes = Counter("cosine_router_resumes_total",
                               "Submit streams resubmitted with resume, by why: the scheduler's stream broke or it handed the request over",
                               ["reason"], registry=registry)
        self.resume_seconds = Histogram("cosine_router_resume_seconds", "from a broken or handed-over stream to the resumed one's first reply",
                                        buckets=LATENCY_BUCKETS, registry=registry)


class DrafterDirectory:
    """The drafter names the deployment has, asked of fusion and cached for a while. While fusion is
    unreachable the names of its last answer stay (None before any answer) and it is asked again a second later."""

    def __init__(self, fusion: fusion_pb2_grpc.FusionStub, ttl_s: float = 10.0, tracing: Tracing | None = None,
                 timeout_s: float = 2.0):
        self.fusion = fusion
        self.tracing = tracing or Tracing("router")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._names: set[str] = set()
        self._answered = False  # fusion answered at least once
        self._fetched = float("-inf")  # when the names were last asked for (a failed ask: a second before it is stale)
        self._fetching: asyncio.Future | None = None

    async def names(self, must_have: list[str] = ()) -> set[str] | None:
        """The drafter names (None: fusion never answered — they cannot be checked)."""
        age = time.monotonic() - self._fetched
        if age > self.ttl_s or (age > 1.0 and any(n not in self._names for n in must_have)):  # new names: once a second at most
            if self._fetching is None or self._fetching.done():  # one fetch at a time, however many requests wait on it
                self._fetching = asyncio.ensure_future(self._fetch())
            await asyncio.shield(self._fetching)
        return self._names if self._answered else None

    async def _fetch(self) -> None:
        try:
            reply = await self.fusion.ListDrafters(common_pb2.InfoRequest(), timeout=self.timeout_s,
                                                   metadata=self.tracing.metadata())
            self._names = {d.name for d in reply.drafters}
            self._answered = True
            self._fetched = time.monotonic()
        except grpc.aio.AioRpcError as exc:  # requests go on without fusion's word; ask again a second later
            self._fetched = time.monotonic() - self.ttl_s + 1.0
            log.warning("fusion is unreachable (%s): drafter names %s", exc.code().name,
                        "from its last answer" if self._answered else "unchecked")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, tokenizer, schedulers: EndpointPool, drafters: DrafterDirectory,
                 limits: policy.Limits, default_drafters: list[str], metrics: RouterMetrics, api_keys: set[str] = frozenset(),
                 tracing: Tracing | None = None, max_streams: int = 0, default_timeout_s: float = 600.0,
                 resume_window_s: float = 10.0):
        self.tokenizer = tokenizer
        self.schedulers = schedulers
        self.resume_window_s = resume_window_s  # how long a broken stream is resumed for before the client hears of it
        self._turn = 0
        self.drafters = drafters
        self.limits = limits
        self.default_drafters = default_drafters
        self.metrics = metrics
        self.api_keys = set(api_keys)
        self.tracing = tracing or Tracing("router")
        self.max_streams = max_streams  # admission limit (0: none)
        self.default_timeout_s = default_timeout_s
        self.streams = 0  # admitted streams in progress
        eos = tokenizer.eos_token_id
        self.stop_token_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))

    def _stream_limit(self) -> int:
        """Most streams this router admits: --max-streams, and no more than the ready schedulers report they admit
        (their verifiers' KV slots; 0: no limit known). The schedulers refuse the excess too (several routers)."""
        ready = [e for e in self.schedulers.endpoints() if e.healthy and e.report is not None]
        capacity = sum(e.report.capacity for e in ready) if ready and all(e.report.capacity for e in ready) else 0
        limits = [n for n in (self.max_streams, capacity) if n]
        return min(limits) if limits else 0

    def _pick(self, exclude: frozenset) -> tuple[Endpoint, bool]:
        """The scheduler for a (re)submission: the least-loaded ready one not in `exclude`, placed there (True:
        release it when the call ends); when none is ready, any known one (a scheduler that is not ready answers
        with its own reason, say Redis being down), not placed."""
        try:
            return self.schedulers.pick(exclude), True
        except ServiceError:
            known = [e for e in self.schedulers.endpoints() if e not in exclude] or self.schedulers.endpoints()
            if not known:
                raise
            self._turn += 1
            return known[self._turn % len(known)], False

    def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if not self.api_keys:
            return
        metadata = dict(context.invocation_metadata() or ())
        auth = metadata.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else ""
        if key not in self.api_keys:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send metadata 'authorization: Bearer <key>'")

    def _tokenize(self, admission: policy.Admission) -> list[int]:
        if admission.text is not None:
            return list(self.tokenizer(admission.text)["input_ids"])
        try:
            ids = self.tokenizer.apply_chat_template(admission.messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template error is the client's to fix
            raise policy.BadRequest(f"messages do not fit the chat template: {exc}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        outcome = "error"
        self.metrics.in_flight.inc()
        admitted = False
        try:
            self._authenticate(context)
            # admission: only what the verifiers' slots hold; the excess is told at once to come back later
            limit = self._stream_limit()
            if limit and self.streams >= limit:
                outcome = "rejected"
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the server is at capacity ({limit} streams in progress); retry later, with backoff")
            self.streams += 1
            admitted = True
            rid = request.request_id or uuid.uuid4().hex
            try:
                known = await self.drafters.names(list(request.speculation.drafters))
                if known is None:  # fusion unreachable: names unchecked, the scheduler decodes plainly until it is back
                    known = set(request.speculation.drafters)
                admission = policy.admit(request, self.limits, known, self.default_drafters, secrets.randbits(63))
                prompt_ids = self._tokenize(admission)
                policy.check_lengths(len(prompt_ids), admission.max_new_tokens, self.limits)
            except policy.BadRequest as exc:
                outcome = "invalid"
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            async for response in self._stream(rid, admission, prompt_ids, context, started):
                yield response
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            outcome = "cancelled"
            raise
        finally:
            if admitted:
                self.streams -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _stream(self, rid, admission: policy.Admission, prompt_ids, context, started):
        s = admission.sampling
        sampling = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        speculation = common_pb2.SpeculationParams(disabled=not admission.speculate, drafters=admission.drafters if admission.speculate else [])
        if admission.max_depth is not None:
            speculation.max_depth = admission.max_depth
        if admission.speculate:  # the request's switches, passed on as they came
            speculation.fusion = admission.fusion
            if admission.routing is not None:
                speculation.routing = admission.routing
            if admission.adaptive_depth is not None:
                speculation.adaptive_depth = admission.adaptive_depth
            if admission.pipelining is not None:
                speculation.pipelining = admission.pipelining
        submit = scheduler_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=prompt_ids, max_new_tokens=admission.max_new_tokens, sampling=sampling,
            speculation=speculation, stop_token_ids=self.stop_token_ids,
            candidate_drafters=admission.candidates if admission.speculate else [],
        )
        if self.tracing.enabled:
            set_span_attributes({"cosine.request_id": rid, "cosine.prompt_tokens": len(prompt_ids),
                                 "cosine.max_new_tokens": admission.max_new_tokens, "cosine.drafters": list(speculation.drafters)})
        remaining = context.time_remaining()
        timeout = self.default_timeout_s if remaining is None else remaining
        deadline = time.monotonic() + timeout
        text = StreamText(self.tokenizer, admission.stop)
        stats = common_pb2.Stats(drafters=list(speculation.drafters))
        completion = 0
        received = 0  # output tokens the schedulers sent that reached the client: the index fence of a resume
        first_at = None
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        exclude: frozenset = frozenset()
        broke_at = None  # when the current stream broke; resuming stops resume_window_s later
        attempt = 0
        while finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            endpoint, placed = self._pick(exclude)
            call = scheduler_pb2_grpc.SchedulerStub(endpoint.channel).Submit(
                submit, timeout=max(0.001, deadline - time.monotonic()), metadata=self.tracing.metadata())
            handover = failure = None
            try:
                async for reply in call:
                    if broke_at is not None:
                        self.metrics.resume_seconds.observe(time.monotonic() - broke_at)
                        broke_at, attempt = None, 0
                    kind = reply.WhichOneof("kind")
                    if kind == "tokens":
                        stats.rounds += 1
                        stats.drafted_tokens += reply.tokens.drafted_tokens
                        stats.accepted_tokens += reply.tokens.accepted_tokens
                        start = reply.tokens.start_index
                        if start > received:  # never happens: a scheduler sends from resume_from on
                            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the request's output lost tokens in a failover; retry")
                        fresh = list(reply.tokens.token_ids)[received - start:]  # the client has the ones before
                        received += len(fresh)
                        ids, delta = text.add(fresh)
                        completion += len(ids)
                        if ids:
                            first_at = first_at or time.perf_counter()
                            self.metrics.tokens.inc(len(ids))
                            yield router_pb2.GenerateResponse(request_id=rid, chunk=router_pb2.Chunk(token_ids=ids, text=delta))
                        if text.stopped:
                            finish = common_pb2.FINISH_REASON_STOP
                            break
                    elif kind == "final":
                        finish = reply.final.finish_reason
                        stats.rounds, stats.drafted_tokens = reply.final.stats.rounds, reply.final.stats.drafted_tokens
                        stats.accepted_tokens = reply.final.stats.accepted_tokens
                        stats.lookup_drafted_tokens = reply.final.stats.lookup_drafted_tokens
                        stats.lookup_accepted_tokens = reply.final.stats.lookup_accepted_tokens
                        del stats.drafters[:]  # the drafters that drafted, as the scheduler's routing chose them
                        stats.drafters.extend(reply.final.stats.drafters)
                    elif kind == "handover":  # the scheduler is stopping: the request goes on elsewhere
                        handover = reply.handover.reason
                        break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    whose = f"the server's default of {self.default_timeout_s:g}s, as the client set none" if remaining is None else "the client's"
                    raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"the request ran past its deadline ({whose}); set a longer deadline or ask for fewer tokens") from None
                if not (broken_stream(exc) or (submit.resume and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)):
                    raise
                failure = exc  # the stream broke (or the scheduler asked to resume on is full): resume elsewhere
            finally:
                call.cancel()  # no-op when the stream ended; stops the request everywhere otherwise
                if placed:
                    self.schedulers.release(endpoint)
            if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
                break
            if handover is None and failure is None:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream without a result; retry")
            # failover: resubmit with resume; the next scheduler takes the request over from Redis
            now = time.monotonic()
            broke_at = broke_at or now
            if now - broke_at > self.resume_window_s or now >= deadline:
                if failure is not None:
                    raise failure
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no scheduler could take the request over; retry")
            self.metrics.resumes.labels("handover" if handover is not None else "broken").inc()
            self.schedulers.mark_down(endpoint)
            exclude = frozenset({endpoint})
            await asyncio.sleep(min(1.0, 0.05 * 2 ** attempt))
            attempt += 1
            submit.resume, submit.resume_from = True, received
            log.info("request %s: resuming from token %d (%s)", rid, received, "handed over" if handover is not None else "stream broke")
        if finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream without a result; retry")
        tail = text.flush()
        if tail:
            yield router_pb2.GenerateResponse(request_id=rid, chunk=router_pb2.Chunk(token_ids=[], text=tail))
        if self.tracing.enabled:
            set_span_attributes({"cosine.completion_tokens": completion, "cosine.rounds": stats.rounds,
                                 "cosine.accepted_tokens": stats.accepted_tokens,
                                 "cosine.finish_reason": common_pb2.FinishReason.Name(finish)})
        if first_at is not None:
            self.metrics.ttft.observe(first_at - started)
            if completion > 1:
                self.metrics.tpot.observe((time.perf_counter() - first_at) / (completion - 1))
        yield router_pb2.GenerateResponse(request_id=rid, final=router_pb2.Final(
            finish_reason=finish,
            usage=router_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion),
            stats=stats,
        ))
