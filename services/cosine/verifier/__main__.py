"""Start the verifier (the target model): `python -m cosine.verifier --model PATH`."""

from __future__ import annotations

from typing import Literal

import torch
from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field

from cosine.common.config import ModelSettings
from cosine.common.server import GrpcService, run_service
from cosine.common.streams import ModelWorker
from cosine.common.v1 import common_pb2
from cosine.common.batching import BatchLimits
from cosine.verifier.batcher import BatchStep, VerifyBatcher
from cosine.verifier.lookup import RunLookup
from cosine.verifier.service import VerifierServicer
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc


class VerifierSettings(ModelSettings):
    """The verifier service (environment: COSINE_VERIFIER_*)."""

    model_config = ModelSettings.model_config | {"env_prefix": "COSINE_VERIFIER_"}

    backend: Literal["auto", "native", "transformers"] = Field(
        "auto", description="auto: the native engine for Llama-family checkpoints, transformers otherwise")
    max_slots: int = Field(16, ge=1, description="most requests holding a KV cache at once (native: preallocated slots)")
    max_batch: int = Field(16, ge=1, description="most requests' rounds verified together in one forward pass (both policies)")
    batch_policy: Literal["fifo", "objective"] = Field(
        "objective", description="which waiting rounds form the next batch: fifo (all of them, oldest first, up to max_batch; "
        "no other cap) or objective (most expected committed tokens plus waiting time minus predicted step time, under "
        "max_batch, max_batch_tokens, max_batch_kv_mb and max_step_ms; a step-time model is fitted online)")
    max_batch_tokens: int = Field(256, ge=2, description="objective: most positions verified in one step (Σ 1 + tree nodes); "
                                  "larger trees are cut, longest first, other rounds wait for the next step")
    max_step_ms: float = Field(0.0, ge=0, description="objective: latency bound of one step; rounds whose predicted step time "
                               "would pass it wait (a step always takes one round; 0: no bound)")
    deadline_ms: float = Field(500.0, ge=0, description="objective: a round waiting this long is taken first, oldest first, "
                               "so none starves (0: no deadline)")
    max_batch_kv_mb: float = Field(0.0, ge=0, description="objective: most KV memory (MiB) a step attends over, Σ over its "
                                   "rounds of (context + tree) positions (0: no cap; native engine only)")
    max_context: int = Field(0, ge=0, description="longest sequence per request (0: the engine's default, at most 4096 for the native engine)")
    feature_head: str = Field("auto", description=(
        "rounds that allow lookup: the drafter conditioned on the target's own features that drafts inside plain steps "
        "beside the lookup (`cosine zoo head` trains it). auto: the zoo's feature-head where it was trained for this "
        "target; off: none; else its directory"))
    head_trees: bool = Field(True, description="the feature head drafts trees (a second candidate where two pass the "
                             "cost floor, at one or two requests a step); false: greedy chains only")
    lookup_row_cost: float = Field(0.3, gt=0, lt=1, description="rounds that allow lookup (VerifyRound.lookup): what one more "
                                   "verified position costs, as a share of a one-request step; a looked-up token is verified "
                                   "where the chance the target accepts it pays for its position at the step's batch size")


async def serve(settings: VerifierSettings) -> GrpcService:
    from cosine.engine.models import tokenizer_fingerprint
    from cosine.engine.native_target import make_target
    from cosine.zoo.registry import TARGET, path_of

    path = path_of(settings.model or TARGET)

    def load():
        if settings.threads:
            torch.set_num_threads(settings.threads)
        return make_target(path, settings.device, settings.dtype, n_slots=settings.max_slots,
                           max_context=settings.max_context or None, backend=settings.backend)

    def load_head():
        from cosine.engine.feature_head import load_for_target

        return load_for_target(settings.feature_head, path, settings.dtype, settings.device)

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    async def on_stop():
        await batcher.close()
        worker.shutdown()

    service = GrpcService("verifier", settings, register, on_stop)
    m = service.metrics
    worker = ModelWorker("verifier", m.worker_busy_seconds.labels("verifier"), m.worker_queue_depth.labels("verifier"))
    engine = await worker.load(load)
    head = await worker.load(load_head)
    batch_size = Histogram("cosine_verifier_batch_size", "requests verified together in one forward pass (the chosen batch)",
                           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=m.registry)
    batch_tokens = Histogram("cosine_verifier_batch_tokens", "positions verified in one step (Σ 1 + tree nodes kept)",
                             buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=m.registry)
    batch_deferred = Histogram("cosine_verifier_batch_deferred", "rounds left waiting by a step (chosen for a later one)",
                               buckets=(0, 1, 2, 4, 8, 16, 32), registry=m.registry)
    trees_trimmed = Counter("cosine_verifier_trees_trimmed", "draft trees cut to fit the token cap of a step",
                            registry=m.registry)
    step_seconds = Histogram("cosine_verifier_step_seconds", "the model thread's time per verification step "
                             "(each step of a decode run on its own; prompt prefills not included)",
                             buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=m.registry)

    def on_batch(step: BatchStep) -> None:
        batch_size.observe(step.size)
        batch_tokens.observe(step.verified_tokens)
        batch_deferred.observe(step.deferred)
        trees_trimmed.inc(step.trimmed)
        step_seconds.observe(step.seconds)

    limits = BatchLimits(max_tokens=settings.max_batch_tokens,
                         max_memory=int(settings.max_batch_kv_mb * 2**20) if settings.max_batch_kv_mb else None,
                         max_step_s=settings.max_step_ms / 1000 if settings.max_step_ms else None,
                         deadline_s=settings.deadline_ms / 1000 if settings.deadline_ms else None)
    batcher = VerifyBatcher(engine, worker, settings.max_batch, on_batch=on_batch, policy=settings.batch_policy, limits=limits,
                            lookup=RunLookup(settings.lookup_row_cost, head=head, head_trees=settings.head_trees))
    lookup_tokens = Counter("cosine_verifier_lookup_tokens", "tokens the verifier drafted itself and verified with plain "
                            "steps (drafted) and those the target accepted (accepted), by source: lookup (the request's "
                            "own tokens) or head (the feature head)", ["outcome", "source"], registry=m.registry)
    servicer = VerifierServicer(engine, worker, path.name, tokenizer_fingerprint(path)[1], settings.max_slots, service.tracing,
                                batcher, opened=m.requests_opened.labels("verifier"), lookup_tokens=lookup_tokens)
    slots = Gauge("cosine_verifier_kv_slots_used", "requests holding a KV cache on the target", registry=m.registry)
    slots.set_function(lambda: len(engine))
    service.servicer = servicer
    service.report_load = lambda: common_pb2.LoadReport(live_requests=servicer.slots_taken, capacity=settings.max_slots,
                                                        queued=batcher.unanswered, busy_seconds=worker.busy_s)
    await service.start()
    await service.set_ready()
    if settings.wedged_after_s:
        service.watch_liveness("the model thread", lambda: worker.running_for() < settings.wedged_after_s,
                               min(5.0, settings.wedged_after_s / 2))
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(VerifierSettings, serve, argv)


if __name__ == "__main__":
    main()
