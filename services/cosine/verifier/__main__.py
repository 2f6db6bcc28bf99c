"""Start the verifier (the target model): `python -m cosine.verifier --model PATH`."""

from __future__ import annotations


import torch
from pydantic import Field

from cosine.common.config import ModelSettings
from cosine.common.server import GrpcService, run_service
from cosine.common.streams import ModelWorker
from cosine.verifier.service import VerifierServicer
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc


class VerifierSettings(ModelSettings):
    """The verifier service (environment: COSINE_VERIFIER_*)."""

    model_config = ModelSettings.model_config | {"env_prefix": "COSINE_VERIFIER_"}

    max_slots: int = Field(256, ge=1, description="most requests holding a KV cache at once")


async def serve(settings: VerifierSettings) -> GrpcService:
    from cosine.engine.hf_target import HFTarget
    from cosine.engine.models import load_causal_lm, tokenizer_fingerprint
    from cosine.zoo.registry import TARGET, path_of

    if settings.threads:
        torch.set_num_threads(settings.threads)
    path = path_of(settings.model or TARGET)
    engine = HFTarget(load_causal_lm(path, settings.device, settings.dtype))
    worker = ModelWorker("verifier")
    servicer = VerifierServicer(engine, worker, path.name, tokenizer_fingerprint(path)[1], settings.max_slots)

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    async def on_stop():
        worker.shutdown()

    service = GrpcService("verifier", settings, register, on_stop)
    service.servicer = servicer
    await service.start()
    await service.set_ready()
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(VerifierSettings, serve, argv)


if __name__ == "__main__":
    main()
