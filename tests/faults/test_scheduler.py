"""Scheduler failover: two scheduler processes behind one router; the one running a stream is SIGKILLed
or SIGTERMed mid-stream (real signals). The router resumes the request on the other (or the same one
restarted), which takes it over from Redis; the client sees one unbroken stream, token for token the
fault-free output (greedy: the target's own; seeded sampling: the same request without a fault)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import grpc
import pytest

from cosine.cluster import free_port
from cosine.common.v1 import common_pb2, common_pb2_grpc
from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.fusion.__main__ import FusionSettings
from cosine.fusion.__main__ import serve as serve_fusion
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.router.v1 import router_pb2, router_pb2_grpc
from cosine.verifier.__main__ import VerifierSettings
from cosine.verifier.__main__ import serve as serve_verifier
from tests.faults.conftest import Proc

COMMON = {"port": 0, "drain_timeout_s": 0.5, "log_level": "WARNING"}
PROMPT = "The history of the printing press begins"
N = 160


def scheduler_proc(verifier: str, fusion: str, redis_url: str, port: int | None = None) -> Proc:
    port = port or free_port()
    argv = [sys.executable, "-m", "cosine.scheduler", "--port", str(port), "--verifier", verifier, "--fusion", fusion,
            "--redis-url", redis_url, "--log-level", "WARNING", "--drain-timeout-s", "10", "--handover-after-s", "0",
            "--lease-s", "2", "--startup-timeout-s", "30",
            "--gate-window-s", "0"]  # no speculation gate: the speculative runs keep drafting through the failover
    return Proc("scheduler", argv, port)


class Cluster:
    def __init__(self, services, schedulers, verifier, fusion, redis_url):
        self.services, self.schedulers = services, schedulers
        self.verifier, self.fusion, self.redis_url = verifier, fusion, redis_url

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.services['router'].port}"

    async def holder(self) -> Proc:
        """The scheduler process whose load report shows a live request."""
        for _ in range(100):
            for proc in self.schedulers:
                async with grpc.aio.insecure_channel(proc.address) as channel:
                    try:
                        report = await common_pb2_grpc.LoadStub(channel).Report(common_pb2.LoadRequest(), timeout=2)
                    except grpc.aio.AioRpcError:
                        continue
                if report.live_requests:
                    return proc
            await asyncio.sleep(0.01)
        raise AssertionError("no scheduler holds the request")


@pytest.fixture
async def cluster(tiny_dirs, redis_server):
    s = {}
    s["verifier"] = await serve_verifier(VerifierSettings(model=str(tiny_dirs["target"]), threads=1, **COMMON))
    s["drafter"] = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
    s["fusion"] = await serve_fusion(FusionSettings(drafters=f"ngram=127.0.0.1:{s['drafter'].port}", **COMMON))
    verifier, fusion = f"127.0.0.1:{s['verifier'].port}", f"127.0.0.1:{s['fusion'].port}"
    schedulers = [scheduler_proc(verifier, fusion, redis_server) for _ in range(2)]
    try:
        await asyncio.gather(*(asyncio.to_thread(p.start) for p in schedulers))
        s["router"] = await serve_router(RouterSettings(
            scheduler=",".join(p.address for p in schedulers), fusion=fusion, model=str(tiny_dirs["target"]),
            default_drafters=["ngram"], pool_poll_interval_s=0.2, max_new_tokens_limit=512, **COMMON))
        yield Cluster(s, schedulers, verifier, fusion, redis_server)
    finally:
        for name in ("router", "fusion", "drafter", "verifier"):
            if name in s:
                await s[name].stop()
        for p in schedulers:
            p.kill()


async def run(router: str, fault=None, **fields) -> tuple[list[int], router_pb2.Final, float]:
    """One Generate stream; `fault` (a coroutine function) runs as a task once the first tokens arrived.
    Returns (token ids, final, seconds)."""
    ids, final, task = [], None, None
    started = time.perf_counter()
    async with grpc.aio.insecure_channel(router) as channel:
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(
                router_pb2.GenerateRequest(prompt=PROMPT.encode(), max_new_tokens=N, **fields), timeout=120):
            if reply.WhichOneof("kind") == "chunk":
                if task is None and fault is not None:
                    task = asyncio.ensure_future(fault())
                ids += reply.chunk.token_ids
            else:
                final = reply.final
    if task is not None:
        await task
    return ids, final, time.perf_counter() - started


def resumes(cluster: Cluster, reason: str) -> float:
    return cluster.services["router"].servicer.metrics.resumes.labels(reason)._value.get()


@pytest.mark.parametrize("fields", [{"speculation": {"disabled": True}}, {"speculation": {"drafters": ["ngram"]}},
                                    {"sampling": {"temperature": 0.9, "top_p": 0.95, "seed": 11}}],
                         ids=["greedy-plain", "greedy-speculative", "seeded-sampling"])
async def test_scheduler_sigkilled_mid_stream_the_other_takes_over_identical(cluster, greedy, fields):
    if "sampling" in fields:  # the fault-free output of the same request
        expected, _, _ = await run(cluster.router, **fields)
        assert len(expected) > 20
    else:
        expected = greedy(PROMPT, N)
    killed = []

    async def kill():
        proc = await cluster.holder()
        proc.signal(signal.SIGKILL)
        killed.append(proc)

    before = resumes(cluster, "broken")
    ids, final, _ = await run(cluster.router, kill, **fields)
    assert killed, "the kill did not happen"
    assert resumes(cluster, "broken") > before, "the kill did not hit the stream"
    assert ids == expected  # no token repeated, none missing, none different
    assert final.usage.completion_tokens == len(expected)
    assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS)


async def test_an_unseeded_sampled_request_resumes_with_the_seed_the_router_chose(cluster):
    import redis.asyncio as aioredis

    from cosine.common.state import RequestStore

    async def kill():
        (await cluster.holder()).signal(signal.SIGKILL)

    rid = f"unseeded-{time.time_ns()}"
    sampling = {"temperature": 1.0, "top_k": 50}  # no seed: the router picks one and Redis keeps it
    ids, _, _ = await run(cluster.router, kill, request_id=rid, sampling=sampling, speculation={"disabled": True})
    assert resumes(cluster, "broken") >= 1
    client = aioredis.from_url(cluster.redis_url)
    try:
        seed = (await RequestStore(client).load(rid)).sampling["seed"]
    finally:
        await client.aclose()
    again, _, _ = await run(cluster.router, sampling={**sampling, "seed": seed}, speculation={"disabled": True})
    assert ids == again  # the resumed stream sampled with the seed chosen before the fault


async def test_scheduler_sigtermed_mid_stream_hands_the_request_over_identical(cluster, greedy):
    terminated = []

    async def terminate():
        proc = await cluster.holder()
        proc.signal(signal.SIGTERM)
        terminated.append(proc)

    before = resumes(cluster, "handover")
    ids, final, _ = await run(cluster.router, terminate, speculation={"drafters": ["ngram"]})
    assert ids == greedy(PROMPT, N)
    assert resumes(cluster, "handover") > before  # handed over (not cut), and resumed on the other
    proc = terminated[0]
    await asyncio.to_thread(proc.popen.wait, 15)  # and the drained scheduler exits by itself
    assert proc.popen.returncode == 0


async def test_the_only_scheduler_restarted_at_its_address_resumes_the_stream(cluster, greedy):
    # one scheduler left: it is SIGKILLed and started again on the same port within the router's resume window
    cluster.schedulers[1].kill()
    only = cluster.schedulers[0]

    async def restart():
        await cluster.holder()
        only.kill()
        await asyncio.to_thread(only.start)

    ids, _, _ = await run(cluster.router, restart, speculation={"disabled": True})
    assert ids == greedy(PROMPT, N)
    assert resumes(cluster, "broken") >= 1
