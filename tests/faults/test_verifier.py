"""The verifier SIGKILLed mid-stream. With no second replica the stream ends UNAVAILABLE within 5 s, the
tokens it got are the target's own, and the message names no internal address. With two, the scheduler
reopens the requests on the other one and every output is the fault-free one."""

from __future__ import annotations

import signal
import sys
import time

import grpc

from cosine.cluster import free_port
from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.fusion.__main__ import FusionSettings
from cosine.fusion.__main__ import serve as serve_fusion
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.__main__ import SchedulerSettings  # gate_window_s=0: adaptive requests keep drafting, so drafters are hit
from cosine.scheduler.__main__ import serve as serve_scheduler
from tests.faults.conftest import Proc, assert_no_address, generate, holding

COMMON = {"port": 0, "drain_timeout_s": 0.5, "log_level": "WARNING"}
PROMPT = "SELECT * FROM users WHERE"


async def test_verifier_sigkilled_mid_stream_is_unavailable_within_5s(tiny_dirs, redis_server, greedy):
    port = free_port()
    verifier = Proc("verifier", [sys.executable, "-m", "cosine.verifier", "--port", str(port), "--model", str(tiny_dirs["target"]),
                                 "--threads", "1", "--log-level", "WARNING"], port).start()
    s = {}
    try:
        s["drafter"] = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
        s["fusion"] = await serve_fusion(FusionSettings(drafters=f"ngram=127.0.0.1:{s['drafter'].port}", **COMMON))
        s["scheduler"] = await serve_scheduler(SchedulerSettings(verifier=verifier.address, fusion=f"127.0.0.1:{s['fusion'].port}",
                                                                 redis_url=redis_server, startup_timeout_s=30, gate_window_s=0, **COMMON))
        s["router"] = await serve_router(RouterSettings(scheduler=f"127.0.0.1:{s['scheduler'].port}", fusion=f"127.0.0.1:{s['fusion'].port}",
                                                        model=str(tiny_dirs["target"]), default_drafters=["ngram"], **COMMON))
        router = f"127.0.0.1:{s['router'].port}"
        killed = []

        def kill():
            killed.append(time.perf_counter())
            verifier.signal(signal.SIGKILL)

        ids, final, err = await generate(router, PROMPT, 256, on_first=kill, speculation={"disabled": True})
        ended = time.perf_counter()
        assert killed and err is not None, "the kill did not hit the stream"
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert ended - killed[0] < 5
        assert ids == greedy(PROMPT, 256)[: len(ids)]
        assert_no_address(err.details())
        assert str(port) not in err.details()
        # a new request while the verifier is gone: UNAVAILABLE at once, no address either
        started = time.perf_counter()
        _, _, err = await generate(router, PROMPT, 8)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and time.perf_counter() - started < 5
        assert_no_address(err.details())
    finally:
        for name in ("router", "scheduler", "fusion", "drafter"):
            if name in s:
                await s[name].stop()
        verifier.kill()


def verifier_proc(tiny_dirs) -> Proc:
    port = free_port()
    return Proc(f"verifier-{port}", [sys.executable, "-m", "cosine.verifier", "--port", str(port), "--model",
                                     str(tiny_dirs["target"]), "--threads", "1", "--log-level", "WARNING"], port)


async def start_over(s: dict, tiny_dirs, redis_server, verifiers: list[Proc], **scheduler) -> str:
    """Drafter, fusion, scheduler (over every verifier) and router into `s`; the router's address."""
    s["drafter"] = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
    s["fusion"] = await serve_fusion(FusionSettings(drafters=f"ngram=127.0.0.1:{s['drafter'].port}", **COMMON))
    s["scheduler"] = await serve_scheduler(SchedulerSettings(
        verifier=",".join(v.address for v in verifiers), fusion=f"127.0.0.1:{s['fusion'].port}",
        redis_url=redis_server, startup_timeout_s=30, gate_window_s=0, **scheduler, **COMMON))
    s["router"] = await serve_router(RouterSettings(scheduler=f"127.0.0.1:{s['scheduler'].port}", fusion=f"127.0.0.1:{s['fusion'].port}",
                                                    model=str(tiny_dirs["target"]), default_drafters=["ngram"], **COMMON))
    return f"127.0.0.1:{s['router'].port}"


async def stop_over(s: dict, verifiers: list[Proc]) -> None:
    for name in ("router", "scheduler", "fusion", "drafter"):
        if name in s:
            await s[name].stop()
    for v in verifiers:
        v.kill()


async def test_verifier_sigkilled_mid_stream_fails_over_to_the_other_replica(tiny_dirs, redis_server, greedy):
    import asyncio

    verifiers = [verifier_proc(tiny_dirs).start(), verifier_proc(tiny_dirs).start()]
    s = {}
    try:
        router = await start_over(s, tiny_dirs, redis_server, verifiers)
        await asyncio.sleep(1)  # the scheduler's pool has seen both ready
        killed = []

        def kill():  # on the first tokens of the first stream: the verifier holding requests now dies
            if not killed:
                victims = holding(verifiers)
                assert victims, "no verifier holds the running requests"
                killed.append(victims[0])
                victims[0].signal(signal.SIGKILL)

        prompts = [PROMPT, "The quick brown fox", "Once upon a time", "def fibonacci(n):"]
        specs = [{"disabled": True}, {"drafters": ["ngram"]}]
        runs = [(p, spec) for p in prompts for spec in specs]
        results = await asyncio.gather(*(generate(router, p, 64, on_first=kill, speculation=spec) for p, spec in runs))
        assert killed, "the kill did not happen"
        for (prompt, spec), (ids, final, err) in zip(runs, results):
            assert err is None, (prompt, spec, err)
            assert ids == greedy(prompt, 64), (prompt, spec)
        moved = s["scheduler"].metrics.registry.get_sample_value("cosine_scheduler_verifier_failovers_total")
        assert moved and moved >= 1, "no request was moved: the kill hit no running request"
        survivor = next(v for v in verifiers if v is not killed[0])
        assert survivor.popen.poll() is None and killed[0].popen.poll() is not None
        # new requests go to the survivor
        ids, _, err = await generate(router, PROMPT, 16)
        assert err is None and ids == greedy(PROMPT, 16)
    finally:
        await stop_over(s, verifiers)


async def test_verifier_sigstopped_mid_stream_past_the_step_deadline_fails_over_or_is_unavailable(tiny_dirs, redis_server, greedy):
    """A hung verifier (SIGSTOP) is taken for dead after the step deadline: with a second replica the requests
    reopen there and complete identical; a request with no replica left ends UNAVAILABLE soon after the deadline."""
    import asyncio

    verifiers = [verifier_proc(tiny_dirs).start(), verifier_proc(tiny_dirs).start()]
    s = {}
    try:
        router = await start_over(s, tiny_dirs, redis_server, verifiers, verify_deadline_s=1.0, open_deadline_s=5.0)
        await asyncio.sleep(1)  # the scheduler's pool has seen both ready
        stopped = []

        def stop():
            if not stopped:
                victims = holding(verifiers)
                assert victims, "no verifier holds the running requests"
                stopped.append((victims[0], time.perf_counter()))
                victims[0].signal(signal.SIGSTOP)

        runs = [(p, spec) for p in [PROMPT, "Once upon a time"] for spec in ({"disabled": True}, {"drafters": ["ngram"]})]
        results = await asyncio.gather(*(generate(router, p, 64, on_first=stop, speculation=spec) for p, spec in runs))
        ended = time.perf_counter()
        assert stopped, "the stop did not happen"
        for (prompt, spec), (ids, final, err) in zip(runs, results):
            assert err is None, (prompt, spec, err)
            assert ids == greedy(prompt, 64), (prompt, spec)
        assert s["scheduler"].metrics.registry.get_sample_value("cosine_scheduler_verifier_failovers_total") >= 1
        assert ended - stopped[0][1] < 1.0 + 10, "the streams waited far past the step deadline"
        # now the survivor hangs too: a running request ends UNAVAILABLE soon after the deadline
        survivor = next(v for v in verifiers if v is not stopped[0][0])
        hung = []

        def stop_survivor():
            if not hung:
                hung.append(time.perf_counter())
                survivor.signal(signal.SIGSTOP)

        ids, _, err = await generate(router, PROMPT, 256, on_first=stop_survivor, speculation={"disabled": True})
        assert hung and err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert time.perf_counter() - hung[0] < 1.0 + 5
        assert ids == greedy(PROMPT, 256)[: len(ids)]
        assert_no_address(err.details())
    finally:
        await stop_over(s, verifiers)
