"""Liveness reports NOT_SERVING while a model thread is wedged (one call running too long), SERVING after."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter


async def liveness(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
        return reply.status


async def wait_for(address: str, status: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while await liveness(address) != status:
        assert time.monotonic() < deadline, f"liveness not {status} within {within_s}s"
        await asyncio.sleep(0.05)


async def test_a_wedged_model_thread_turns_liveness_off_until_it_returns():
    service = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", port=0, drain_timeout_s=0.2, wedged_after_s=0.4))
    address = f"127.0.0.1:{service.port}"
    try:
        assert await liveness(address) == health_pb2.HealthCheckResponse.SERVING
        service.servicer.worker.submit(time.sleep, 2.0)  # the model thread is stuck in one call
        await wait_for(address, health_pb2.HealthCheckResponse.NOT_SERVING, 1.5)
        await wait_for(address, health_pb2.HealthCheckResponse.SERVING, 3.0)
    finally:
        await service.stop()
