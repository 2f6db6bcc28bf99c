"""Start the verifier (the target model): `python -m cosine.verifier --model PATH`."""

from __future__ import annotations

from typing import Literal

import torch
from prometheus_client import Gauge, Histogram
from pydantic import Field

from cosine.common.config import ModelSettings
from cosine.common.server import GrpcService, run_service
from cosine.common.streams import ModelWorker
from cosine.verifier.batcher import VerifyBatcher
from cosine.verifier.service import VerifierServicer
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc


class VerifierSettings(ModelSettings):
    """The verifier service (environment: COSINE_VERIFIER_*)."""

    model_config = ModelSettings.model_config | {"env_prefix": "COSINE_VERIFIER_"}

    backend: Literal["auto", "native", "transformers"] = Field(
        "auto", description="auto: the native engine for Llama-family checkpoints, transformers otherwise")
    max_slots: int = Field(16, ge=1, description="most requests holding a KV cache at once (native: preallocated slots)")
    max_batch: int = Field(8, ge=1, description="most requests' rounds verified together in one forward pass")
    max_context: int = Field(0, ge=0, description="longest sequence per request (0: the engine's default, at most 4096 for the native engine)")


async def serve(settings: VerifierSettings) -> GrpcService:
    from cosine.engine.models import tokenizer_fingerprint
    from cosine.engine.native_target import make_target
    from cosine.zoo.registry import TARGET, path_of

    if settings.threads:
        torch.set_num_threads(settings.threads)
    path = path_of(settings.model or TARGET)
    engine = make_target(path, settings.device, settings.dtype, n_slots=settings.max_slots,
                         max_context=settings.max_context or None, backend=settings.backend)

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    async def on_stop():
        await batcher.close()
        worker.shutdown()

    service = GrpcService("verifier", settings, register, on_stop)
    m = service.metrics
    worker = ModelWorker("verifier", m.worker_busy_seconds.labels("verifier"), m.worker_queue_depth.labels("verifier"))
    batch_size = Histogram("cosine_verifier_batch_size", "requests verified together in one forward pass",
                           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=m.registry)
    batcher = VerifyBatcher(engine, worker, settings.max_batch, on_batch=lambda n, seconds: batch_size.observe(n))
    servicer = VerifierServicer(engine, worker, path.name, tokenizer_fingerprint(path)[1], settings.max_slots, service.tracing,
                                batcher)
    slots = Gauge("cosine_verifier_kv_slots_used", "requests holding a KV cache on the target", registry=m.registry)
    slots.set_function(lambda: len(engine))
    service.servicer = servicer
    await service.start()
    await service.set_ready()
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(VerifierSettings, serve, argv)


if __name__ == "__main__":
    main()
