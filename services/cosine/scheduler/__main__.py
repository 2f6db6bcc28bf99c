"""Start the scheduler: `python -m cosine.scheduler --verifier HOST:PORT --fusion HOST:PORT --redis-url URL`.

--verifier and --fusion also take several replicas (HOST:PORT,HOST:PORT, dns:///HOST:PORT or file:PATH):
each new request goes to the least-loaded one and stays there (`cosine.common.pool`)."""

from __future__ import annotations

import logging

from pydantic import Field, field_validator

from cosine.common.config import ServiceSettings
from cosine.common.pool import EndpointPool, parse_targets
from cosine.common.server import GrpcService, run_service
from cosine.common.state import RequestStore, connect
from cosine.common.v1 import common_pb2
from cosine.fusion.v1 import fusion_pb2_grpc
from cosine.scheduler.service import SchedulerConfig, SchedulerMetrics, SchedulerServicer
from cosine.scheduler.switches import Switches
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from cosine.verifier.v1 import verifier_pb2_grpc

log = logging.getLogger(__name__)


class SchedulerSettings(ServiceSettings):
    """The scheduler service (environment: COSINE_SCHEDULER_*)."""

    model_config = ServiceSettings.model_config | {"env_prefix": "COSINE_SCHEDULER_"}

    verifier: str = Field("127.0.0.1:50054", description=(
        "verifier replicas: HOST:PORT[,HOST:PORT...], dns:///HOST:PORT (every address, resolved again) or file:PATH "
        "(HOST:PORT lines, read again); each request goes to the least-loaded one"))
    fusion: str = Field("127.0.0.1:50053", description="fusion replicas, in the same forms as --verifier")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding request state")
    state_ttl_s: int = Field(3600, ge=1, description="TTL of a live request's state, refreshed on every write")
    finished_ttl_s: int = Field(600, ge=1, description="how long an ended request's state is kept")
    redis_timeout_s: float = Field(2.0, gt=0, description="socket timeout of each Redis call (connect and reply); "
                                   "a Redis call fails with UNAVAILABLE within about twice this")
    redis_check_interval_s: float = Field(1.0, gt=0, description="how often readiness checks Redis (NOT_SERVING while unreachable)")
    default_depth: int = Field(4, ge=0, description="draft depth per round unless a request says otherwise")
    max_depth: int = Field(16, ge=0, description="largest draft depth a request may ask for")
    startup_timeout_s: float = Field(600, ge=1, description="how long to wait for verifier and fusion at start-up")
    switches: str = Field("", description=(
        "mechanisms on/off, e.g. 'routing=off,fusion=merge,adaptive_depth=off,fixed_depth=3' "
        "(routing on|off, fusion confidence|merge|single, adaptive_depth on|off, fixed_depth N, fixed_drafter NAME, "
        "pipelining on|off: draft the next round ahead while one request's round is verified); empty: the full system. "
        "fixed_depth defaults to default_depth"))
    routing_k: int = Field(2, ge=1, description="drafters per request expertise routing starts with")
    routing_max_k: int = Field(3, ge=1, description="most drafters per request when the verifier idles")
    routing_threshold: float = Field(1.0, ge=0, description="recent accepted length below which routing tries another drafter")
    verifier_queue_high: int = Field(4, ge=1, description="requests waiting on the verifier at which speculation shrinks")
    step_max_requests: int = Field(16, ge=1, description="most requests the step loop verifies in one step")
    step_max_tokens: int = Field(256, ge=2, description="most positions the step loop verifies in one step (Σ 1 + tree nodes)")
    gate_window_s: float = Field(0.5, ge=0, description=(
        "window of the speculation gate: adaptive requests draft only at loads where windows that drafted committed "
        "more tokens per second than windows that did not (0: no gate)"))
    max_admitted: int = Field(0, ge=0, description=(
        "admission: most requests in progress; the excess gets RESOURCE_EXHAUSTED at once (0: the KV slots of the "
        "ready verifiers, as their load reports give them)"))
    lease_s: float = Field(5.0, gt=0, description=(
        "how long a request stays claimed in Redis without word from its scheduler (renewed a third of this apart); "
        "after it runs out, the request's id may be used again at once"))
    draft_deadline_s: float = Field(3.0, gt=0, description=(
        "shortest deadline of one round's drafts at fusion (the deadline is 10 × the request's measured draft time, "
        "at least this); past it, or when fusion fails, the request moves to another fusion replica or decodes plainly"))
    first_draft_deadline_s: float = Field(15.0, gt=0, description=(
        "deadline of a request's first round at fusion (its drafters prefill the prompt; above fusion's "
        "--drafter-first-call-s)"))
    fusion_retry_s: float = Field(5.0, gt=0, description=(
        "a request that decodes plainly for want of fusion (its stream failed, or none was ready) tries a ready "
        "fusion replica again after this many seconds"))
    verify_deadline_s: float = Field(5.0, gt=0, description=(
        "shortest deadline of one verification step (the deadline is 10 × the measured step time, at least this); "
        "past it the verifier is taken for dead and its requests fail over to another replica"))
    open_deadline_s: float = Field(30.0, gt=0, description=(
        "shortest deadline of a verification step that opens requests (the verifier prefills their prompts)"))
    decode_steps: int = Field(4, ge=1, le=64, description=(
        "most tokens a request decodes plainly per verifier round trip (a decode run): when no request of a step "
        "drafts or opens, the verifier runs up to this many steps back to back and answers once, so the round trip, "
        "the Redis commit and the stream message are paid once per run; tokens then stream in groups of up to this "
        "many. The tokens are the same as with 1 (one round trip per token)"))
    decode_run_s: float = Field(0.1, gt=0, description=(
        "a decode run has no more steps than fit in this many seconds by the recent step time (a request arriving "
        "during a run waits for its end)"))
    lookup_tokens: int = Field(8, ge=0, le=16, description=(
        "most tokens the verifier may look up in a request's own tokens (prompt lookup by the longest suffix match) "
        "and verify with each plain step of it, for a request under adaptive speculation: no round trip and no "
        "drafter, so it works inside decode runs; the target accepts only what it would write anyway (0: off)"))
    handover_after_s: float | None = Field(None, ge=0, description=(
        "on SIGTERM, how long live requests may finish before they are handed over to another scheduler through "
        "Redis (unset: drain_timeout_s minus 3 s)"))

    @field_validator("verifier", "fusion")
    @classmethod
    def _parse_targets(cls, value: str) -> str:
        parse_targets(value)
        return value

    @field_validator("switches")
    @classmethod
    def _parse_switches(cls, value: str) -> str:
        Switches.parse(value)
        return value

    def parsed_switches(self) -> Switches:
        sw = Switches.parse(self.switches)
        explicit = any(part.split("=")[0].strip().replace("-", "_") == "fixed_depth" for part in self.switches.split(","))
        return sw if explicit else sw.replace(fixed_depth=self.default_depth)


class TokenizerMismatch(RuntimeError):
    pass


async def check_models(verifier: verifier_pb2_grpc.VerifierStub, fusion: fusion_pb2_grpc.FusionStub, timeout: float):
    """The target's and every drafter's vocabulary must agree; returns (target info, drafter infos)."""
    target = await verifier.Info(common_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout)
    drafters = (await fusion.ListDrafters(common_pb2.InfoRequest(), wait_for_ready=True, timeout=timeout)).drafters
    for d in drafters:
        if d.vocab_size and d.vocab_size != target.vocab_size:
            raise TokenizerMismatch(f"drafter {d.name} has vocabulary {d.vocab_size}, the target {target.vocab_size}")
        if d.tokenizer_hash and target.tokenizer_hash and d.tokenizer_hash != target.tokenizer_hash:
            raise TokenizerMismatch(f"drafter {d.name}'s tokenizer differs from the target's ({d.tokenizer_hash} vs {target.tokenizer_hash})")
    return target, list(drafters)


async def serve(settings: SchedulerSettings) -> GrpcService:
    verifiers = EndpointPool("verifier", settings.verifier, settings)
    fusions = EndpointPool("fusion", settings.fusion, settings)
    await verifiers.start()
    await fusions.start()
    client = connect(settings.redis_url, settings.redis_timeout_s)
    await client.ping()
    store = RequestStore(client, settings.state_ttl_s, settings.finished_ttl_s, settings.lease_s)

    def register(server):
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        return [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name]

    async def on_stop():
        await servicer.close()
        await verifiers.close()
        await fusions.close()
        await client.aclose()

    handover_after_s = (settings.handover_after_s if settings.handover_after_s is not None
                        else max(0.0, settings.drain_timeout_s - 3.0))

    async def on_drain():
        await servicer.drain(handover_after_s)

    service = GrpcService("scheduler", settings, register, on_stop, on_drain)
    config = SchedulerConfig(settings.default_depth, settings.max_depth, switches=settings.parsed_switches(),
                             routing_k=settings.routing_k, routing_max_k=max(settings.routing_k, settings.routing_max_k),
                             routing_threshold=settings.routing_threshold, verifier_queue_high=settings.verifier_queue_high,
                             step_max_requests=settings.step_max_requests, step_max_tokens=settings.step_max_tokens,
                             gate_window_s=settings.gate_window_s, draft_deadline_s=settings.draft_deadline_s,
                             first_draft_deadline_s=settings.first_draft_deadline_s, fusion_retry_s=settings.fusion_retry_s,
                             verify_deadline_s=settings.verify_deadline_s, open_deadline_s=settings.open_deadline_s,
                             decode_steps=settings.decode_steps, decode_run_s=settings.decode_run_s,
                             lookup_tokens=settings.lookup_tokens)
    servicer = SchedulerServicer(store, verifiers, fusions, config, SchedulerMetrics(service.metrics.registry), service.tracing)
    service.servicer = servicer
    service.report_load = lambda: common_pb2.LoadReport(live_requests=len(servicer.live), queued=len(servicer.live),
                                                        capacity=servicer.max_requests)
    await service.start()
    # one ready replica of each answers for its role (replicas run the same models)
    verifier = verifier_pb2_grpc.VerifierStub((await verifiers.wait_ready(settings.startup_timeout_s)).channel)
    fusion = fusion_pb2_grpc.FusionStub((await fusions.wait_ready(settings.startup_timeout_s)).channel)
    target, drafters = await check_models(verifier, fusion, settings.startup_timeout_s)
    config.max_context = target.max_context
    servicer.max_admitted = settings.max_admitted
    log.info("target %s (vocab %d, context %d); drafters %s; switches %s; admits %s requests", target.name, target.vocab_size,
             target.max_context, [d.name for d in drafters], config.switches, servicer.max_requests or "any number of")
    await service.set_ready()
    service.watch_readiness("Redis", store.reachable, settings.redis_check_interval_s)
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(SchedulerSettings, serve, argv, refuse=(TokenizerMismatch,))


if __name__ == "__main__":
    main()
