"""All five services in this process, on port 0, with tiny models and a real Redis server."""

from __future__ import annotations

import pytest

from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.fusion.__main__ import FusionSettings
from cosine.fusion.__main__ import serve as serve_fusion
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.__main__ import SchedulerSettings
from cosine.scheduler.__main__ import serve as serve_scheduler
from cosine.verifier.__main__ import VerifierSettings
from cosine.verifier.__main__ import serve as serve_verifier


class LocalServices:
    def __init__(self, services: dict):
        self.services = services

    def __getitem__(self, name):
        return self.services[name]

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.services['router'].port}"


async def start_services(tiny_dirs, redis_url: str, **extra) -> LocalServices:
    """Every service on port 0; `extra` settings go to all of them (e.g. trace_exporter="memory")."""
    started = {}
    common = {"port": 0, "drain_timeout_s": 1.0, "metrics_port": 0, **extra}
    started["verifier"] = await serve_verifier(VerifierSettings(model=str(tiny_dirs["target"]), threads=1, **common))
    started["drafter-ngram"] = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **common))
    started["drafter-tiny"] = await serve_drafter(DrafterSettings(name="tiny", kind="lm", model=str(tiny_dirs["drafter"]), threads=1, **common))
    endpoints = f"ngram=127.0.0.1:{started['drafter-ngram'].port},tiny=127.0.0.1:{started['drafter-tiny'].port}"
    started["fusion"] = await serve_fusion(FusionSettings(drafters=endpoints, **common))
    started["scheduler"] = await serve_scheduler(SchedulerSettings(
        verifier=f"127.0.0.1:{started['verifier'].port}", fusion=f"127.0.0.1:{started['fusion'].port}",
        redis_url=redis_url, startup_timeout_s=30,
        # no speculation gate: these tests check what each mechanism does when requests draft, so adaptive
        # requests must not stop drafting because plain decoding measured faster (test_gate.py covers the gate)
        gate_window_s=0, **common))
    started["router"] = await serve_router(RouterSettings(
        scheduler=f"127.0.0.1:{started['scheduler'].port}", fusion=f"127.0.0.1:{started['fusion'].port}",
        model=str(tiny_dirs["target"]), max_new_tokens_limit=256, **common))
    return LocalServices(started)


async def stop_services(services: LocalServices) -> None:
    for name in ("router", "scheduler", "fusion", "drafter-tiny", "drafter-ngram", "verifier"):
        await services[name].stop()


@pytest.fixture(scope="session")
async def services(tiny_dirs, redis_server):
    started = await start_services(tiny_dirs, redis_server)
    yield started
    await stop_services(started)
