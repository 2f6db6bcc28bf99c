"""Start the fusion service: `python -m cosine.fusion --drafters ngram=127.0.0.1:50061,...`.

A drafter named twice has two replicas (`suffix=127.0.0.1:50061,suffix=127.0.0.1:50062`); an address may
also be dns:///HOST:PORT or file:PATH. Each request stays on the replica of each drafter it was placed on."""

from __future__ import annotations

import asyncio

from pydantic import Field, field_validator

from cosine.common.config import ServiceSettings
from cosine.common.pool import EndpointPool, parse_targets
from cosine.common.server import GrpcService, run_service
from cosine.fusion.health import HealthConfig
from cosine.fusion.calibration import CalibrationTable
from cosine.fusion.service import FusionMetrics, FusionServicer
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc


def parse_endpoints(value: str | dict) -> dict[str, str]:
    """'name=host:port,name=host:port' (or a dict) → {name: targets}; a name given twice gets both addresses
    ("host:port,host:port"), each address may be dns:///HOST:PORT or file:PATH (see cosine.common.pool)."""
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    endpoints: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise ValueError(f"drafter endpoint {item!r} is not NAME=HOST:PORT")
        endpoints.setdefault(name, []).append(address)
    out = {}
    for name, addresses in endpoints.items():
        if len(addresses) > 1 and any(parse_targets(a)[0] != "list" for a in addresses):
            raise ValueError(f"drafter {name}: a dns:/// or file: address must be its only one")
        out[name] = ",".join(addresses)
        parse_targets(out[name])
    return out


class FusionSettings(ServiceSettings):
    """The fusion service (environment: COSINE_FUSION_*)."""

    model_config = ServiceSettings.model_config | {"env_prefix": "COSINE_FUSION_"}

    drafters: str = Field("", description="drafter endpoints: NAME=HOST:PORT,NAME=HOST:PORT")
    top_k: int = Field(3, ge=1, le=16, description="confidence fusion: candidates each drafter proposes per step")
    # a drafter that fails, hangs or is full is dropped for that request, which goes on with the rest (or plain decoding)
    drafter_deadline_floor_s: float = Field(1.0, gt=0, description="shortest deadline of one drafter call")
    drafter_deadline_factor: float = Field(5.0, ge=1, description="a call's deadline: this × the drafter's measured time per drafted position × positions")
    drafter_first_call_s: float = Field(10.0, gt=0, description="shortest deadline of a request's first call to a drafter (it prefills the prompt)")
    drafter_failures_to_skip: int = Field(3, ge=1, description="failures in a row after which new requests skip a drafter until it passes a health check")
    drafter_backoff_s: float = Field(2.0, gt=0, description="wait before a skipped drafter is first health-checked (doubles while it fails)")
    drafter_max_backoff_s: float = Field(30.0, gt=0, description="longest wait between health checks of a skipped drafter")
    calibrate: bool = Field(True, description=(
        "rank and report drafters' candidates by their calibrated probability: the acceptance rate fusion observed "
        "for what each drafter states (false: as stated; the calibration error is measured either way)"))

    @field_validator("drafters")
    @classmethod
    def _parse(cls, value: str) -> str:
        parse_endpoints(value)
        return value

    @property
    def endpoints(self) -> dict[str, str]:
        return parse_endpoints(self.drafters)

    def health(self) -> HealthConfig:
        return HealthConfig(failures_to_skip=self.drafter_failures_to_skip, backoff_s=self.drafter_backoff_s,
                            max_backoff_s=max(self.drafter_backoff_s, self.drafter_max_backoff_s),
                            floor_s=self.drafter_deadline_floor_s, factor=self.drafter_deadline_factor,
                            first_s=self.drafter_first_call_s)


async def serve(settings: FusionSettings) -> GrpcService:
    pools = {name: EndpointPool(f"drafter {name}", targets, settings) for name, targets in settings.endpoints.items()}
    await asyncio.gather(*(pool.start() for pool in pools.values()))

    def register(server):
        fusion_pb2_grpc.add_FusionServicer_to_server(servicer, server)
        return [fusion_pb2.DESCRIPTOR.services_by_name["Fusion"].full_name]

    async def on_stop():
        await asyncio.gather(*(pool.close() for pool in pools.values()))

    service = GrpcService("fusion", settings, register, on_stop)
    servicer = FusionServicer(pools,
                              FusionMetrics(service.metrics.registry), service.tracing, settings.top_k, settings.health(),
                              calibration=CalibrationTable(enabled=settings.calibrate))
    service.servicer = servicer
    await service.start()
    await service.set_ready()
    return service


def main(argv: list[str] | None = None) -> None:
    run_service(FusionSettings, serve, argv)


if __name__ == "__main__":
    main()
