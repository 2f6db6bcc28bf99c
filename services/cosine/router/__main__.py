"""Start the router (the public Generate stream): `python -m cosine.router --scheduler HOST:PORT`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from cosine.common.config import ServiceSettings
from cosine.common.pool import EndpointPool
from cosine.common.server import GrpcService, open_channel, run_service
from cosine.fusion.v1 import fusion_pb2_grpc
from cosine.router import policy
from cosine.router.service import DrafterDirectory, RouterMetrics, RouterServicer
from cosine.router.v1 import router_pb2, router_pb2_grpc


class RouterSettings(ServiceSettings):
    """The router (environment: COSINE_ROUTER_*)."""

    model_config = ServiceSettings.model_config | {"env_prefix": "COSINE_ROUTER_"}

    port: int = Field(50051, ge=0, le=65535, description="gRPC port of the public Generate stream")
    scheduler: str = Field("127.0.0.1:50052", description=(
        "scheduler addresses: HOST:PORT[,HOST:PORT...], dns:///HOST:PORT (every replica) or file:PATH; a request whose "
        "scheduler dies or drains is resumed on another"))
    resume_window_s: float = Field(10.0, ge=0, description=(
        "how long a request whose scheduler stream broke is resubmitted (with resume, backing off to 1 s) before "
        "the client gets UNAVAILABLE"))
    fusion: str = Field("127.0.0.1:50053", description="fusion address, asked which drafters exist")
    model: str = Field("", description="directory with the target's tokenizer and config (empty: the zoo's target)")
    default_drafters: list[str] = Field(["ngram"], description="drafters for requests that name none, best first")
    max_new_tokens_default: int = Field(128, ge=1)
    max_new_tokens_limit: int = Field(2048, ge=1)
    max_depth: int = Field(16, ge=0, description="largest speculation.max_depth accepted")
    api_keys: list[str] = Field([], description="if set, callers must send 'authorization: Bearer <key>'")
    api_keys_file: str = Field("", description="file with a JSON list of further accepted keys (e.g. a mounted Secret)")
    max_streams: int = Field(16, ge=0, description=(
        "admission: most Generate streams in progress at once; the excess gets RESOURCE_EXHAUSTED at once "
        "(set it to the KV slots the verifiers hold, Σ max_slots; 0: no limit)"))
    default_timeout_s: float = Field(600.0, gt=0, description="deadline of a request whose client set none")

    def accepted_keys(self) -> set[str]:
        keys = set(self.api_keys)
        if self.api_keys_file:
            listed = json.loads(Path(self.api_keys_file).read_text())
            if not isinstance(listed, list) or not all(isinstance(k, str) and k for k in listed):
                raise ValueError(f"{self.api_keys_file} must hold a JSON list of non-empty strings")
            keys |= set(listed)
        return keys


async def serve(settings: RouterSettings) -> GrpcService:
    from transformers import AutoConfig, AutoTokenizer

    from cosine.zoo.registry import TARGET, path_of

    path = path_of(settings.model or TARGET)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    max_context = int(getattr(AutoConfig.from_pretrained(str(path)), "max_position_embeddings", 2048))
    limits = policy.Limits(settings.max_new_tokens_default, settings.max_new_tokens_limit, max_context, max_depth=settings.max_depth)
    schedulers = EndpointPool("scheduler", settings.scheduler, settings)
    await schedulers.start()
    fusion_channel = open_channel(settings.fusion, settings)

    def register(server):
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        return [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name]

    async def on_stop():
        await schedulers.close()
        await fusion_channel.close()

    service = GrpcService("router", settings, register, on_stop)
    servicer = RouterServicer(
        tokenizer,
        schedulers,
        DrafterDirectory(fusion_pb2_grpc.FusionStub(fusion_channel), tracing=service.tracing),
        limits,
        settings.default_drafters,
        RouterMetrics(service.metrics.registry),
        settings.accepted_keys(),
        service.tracing,
        max_streams=settings.max_streams,
        default_timeout_s=settings.default_timeout_s,
        resume_window_s=settings.resume_window_s,
    )
    service.servicer = servicer
    await service.start()
    await service.set_ready()
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(RouterSettings, serve, argv)


if __name__ == "__main__":
    main()
