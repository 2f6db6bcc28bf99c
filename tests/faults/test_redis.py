"""Redis faults through the whole path: a real redis-server SIGKILLed, SIGSTOPped, restarted and filled.
Every request completes identically or ends UNAVAILABLE (RESOURCE_EXHAUSTED when Redis is full), with a
message that says what is wrong; never INTERNAL; the scheduler's readiness follows Redis."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.faults.conftest import assert_no_address, generate, redis_proc
from tests.integration.conftest import start_services, stop_services

PROMPT = "The quick brown fox jumps over the lazy dog"
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
async def cluster(tiny_dirs):
    redis = redis_proc().start()
    services = await start_services(tiny_dirs, f"redis://127.0.0.1:{redis.port}/0", drain_timeout_s=0.5, log_level="WARNING",
                                    redis_timeout_s=TIMEOUT_S, redis_check_interval_s=0.2)
    yield services, redis
    await stop_services(services)
    redis.kill()


async def readiness(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
        return reply.status


async def wait_readiness(address: str, status: int, within_s: float) -> float:
    started = time.monotonic()
    while await readiness(address) != status:
        assert time.monotonic() - started < within_s, f"readiness not {status} after {within_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_redis_down_is_unavailable_readiness_follows_and_recovery_is_clean(cluster, greedy):
    services, redis = cluster
    scheduler = f"127.0.0.1:{services['scheduler'].port}"
    assert await readiness(scheduler) == health_pb2.HealthCheckResponse.SERVING
    redis.kill()
    started = time.perf_counter()
    _, _, err = await generate(services.router, PROMPT, 16)
    took = time.perf_counter() - started
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "state store" in err.details() and "retry" in err.details()
    assert_no_address(err.details())
    assert took < 4 * TIMEOUT_S + 1
    await wait_readiness(scheduler, health_pb2.HealthCheckResponse.NOT_SERVING, 5)
    redis.start()  # the same port, empty (no persistence)
    await wait_readiness(scheduler, health_pb2.HealthCheckResponse.SERVING, 5)
    ids, final, err = await generate(services.router, PROMPT, 16)
    assert err is None and ids == greedy(PROMPT, 16)


async def test_a_hung_redis_times_out_as_unavailable(cluster, greedy):
    services, redis = cluster
    redis.signal(signal.SIGSTOP)
    try:
        started = time.perf_counter()
        _, _, err = await generate(services.router, PROMPT, 16)
        took = time.perf_counter() - started
    finally:
        redis.signal(signal.SIGCONT)
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "timed out" in err.details()
    assert took < 4 * TIMEOUT_S + 1  # the configured socket timeout, one retry
    await wait_readiness(f"127.0.0.1:{services['scheduler'].port}", health_pb2.HealthCheckResponse.SERVING, 5)
    ids, _, err = await generate(services.router, PROMPT, 16)
    assert err is None and ids == greedy(PROMPT, 16)


async def test_redis_restarted_mid_load_every_stream_completes_identical_or_is_unavailable(cluster, greedy):
    services, redis = cluster
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    hit = threading.Event()

    def restart():
        if not hit.is_set():
            hit.set()
            redis.kill()
            threading.Thread(target=redis.start, daemon=True).start()

    results = await asyncio.gather(*(generate(services.router, p, 200, on_first=restart, speculation={"disabled": True})
                                     for p in prompts))
    assert hit.is_set()
    codes = [err.code() if err else grpc.StatusCode.OK for _, _, err in results]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    assert grpc.StatusCode.UNAVAILABLE in codes  # the restart hit streams in flight
    for prompt, (ids, _, err) in zip(prompts, results):
        expected = greedy(prompt, 200)
        if err is None:
            assert ids == expected
        else:
            assert ids == expected[: len(ids)]  # what was streamed before the fault is the target's own output
            assert_no_address(err.details())
    await wait_readiness(f"127.0.0.1:{services['scheduler'].port}", health_pb2.HealthCheckResponse.SERVING, 10)
    ids, _, err = await generate(services.router, PROMPT, 16)
    assert err is None and ids == greedy(PROMPT, 16)


async def test_a_full_redis_gives_resource_exhausted_and_the_scheduler_survives(cluster, greedy):
    services, redis = cluster
    client = aioredis.from_url(f"redis://127.0.0.1:{redis.port}/0")
    try:
        await client.config_set("maxmemory-policy", "noeviction")
        for i in range(32):  # 2 MiB of other data, then a limit below what Redis holds: it is full
            await client.set(f"junk:{i}", b"x" * 64 * 1024)
        used = int((await client.info("memory"))["used_memory"])
        await client.config_set("maxmemory", str(used - 256 * 1024))
        with pytest.raises(redis_errors.OutOfMemoryError):
            await client.set("one-more", b"x")
        _, _, err = await generate(services.router, PROMPT, 16)
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "full" in err.details() and "retry later" in err.details()
        await client.flushall()
        await client.config_set("maxmemory", "0")
    finally:
        await client.aclose()
    ids, _, err = await generate(services.router, PROMPT, 16)
    assert err is None and ids == greedy(PROMPT, 16)
