"""Fusion is a pod too. Killed mid-stream with a second replica, its requests reopen at the other one with
everything they committed and go on drafting; with none, or stopped (SIGSTOP) past the scheduler's draft
deadline, they decode plainly. Drafting is optional, so every output is exactly the target's greedy output,
and a new request while fusion is dead or hung completes too."""

from __future__ import annotations

import asyncio
import signal
import sys
import time


from cosine.cluster import free_port
from cosine.drafter.__main__ import DrafterSettings
from cosine.drafter.__main__ import serve as serve_drafter
from cosine.router.__main__ import RouterSettings
from cosine.router.__main__ import serve as serve_router
from cosine.scheduler.__main__ import SchedulerSettings  # gate_window_s=0: adaptive requests keep drafting, so fusion is hit
from cosine.scheduler.__main__ import serve as serve_scheduler
from cosine.verifier.__main__ import VerifierSettings
from cosine.verifier.__main__ import serve as serve_verifier
from tests.faults.conftest import Proc, generate, holding, on_first

COMMON = {"port": 0, "drain_timeout_s": 0.5, "log_level": "WARNING"}
PROMPTS = ["SELECT * FROM users WHERE", "def fibonacci(n): return n if n < 2 else fibonacci(n - 1)",
           "The quick brown fox jumps over the lazy dog. The quick brown fox", "Once upon a time"]
SPECS = [{"speculation": {"drafters": ["ngram"]}}, {}]  # named drafter; the router's default candidates (routing)
N = 64


def fusion_proc(drafter: str) -> Proc:
    port = free_port()
    return Proc(f"fusion-{port}", [sys.executable, "-m", "cosine.fusion", "--port", str(port), "--drafters", f"ngram={drafter}",
                                   "--log-level", "WARNING", "--drain-timeout-s", "0"], port)


async def start(tiny_dirs, redis_server, fusions: list[Proc], **scheduler) -> dict:
    s = {}
    s["verifier"] = await serve_verifier(VerifierSettings(model=str(tiny_dirs["target"]), threads=1, **COMMON))
    s["scheduler"] = await serve_scheduler(SchedulerSettings(
        verifier=f"127.0.0.1:{s['verifier'].port}", fusion=",".join(f.address for f in fusions), redis_url=redis_server,
        startup_timeout_s=30, gate_window_s=0, pool_poll_interval_s=0.2,
        **({"draft_deadline_s": 1.0, "first_draft_deadline_s": 3.0} | scheduler), **COMMON))
    s["router"] = await serve_router(RouterSettings(scheduler=f"127.0.0.1:{s['scheduler'].port}", fusion=fusions[0].address,
                                                    model=str(tiny_dirs["target"]), default_drafters=["ngram"], **COMMON))
    await asyncio.sleep(0.6)  # the scheduler's pool has seen every fusion replica ready
    return s


async def stop(s: dict) -> None:
    for name in ("router", "scheduler", "verifier", "drafter"):
        if name in s:
            await s[name].stop()


def failovers(s, outcome: str) -> float:
    return s["scheduler"].metrics.registry.get_sample_value("cosine_scheduler_fusion_failovers_total",
                                                            {"outcome": outcome}) or 0.0


async def test_fusion_sigkilled_mid_stream_requests_reopen_at_the_other_replica_identical(tiny_dirs, redis_server, greedy):
    drafter = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
    fusions = [fusion_proc(f"127.0.0.1:{drafter.port}").start(), fusion_proc(f"127.0.0.1:{drafter.port}").start()]
    s = {"drafter": drafter}
    try:
        s.update(await start(tiny_dirs, redis_server, fusions))
        router = f"127.0.0.1:{s['router'].port}"
        killed = []

        def kill():  # on the first tokens of the first stream: a fusion replica holding requests now dies
            if not killed:
                victims = holding(fusions)
                assert victims, "no fusion replica holds the running requests"
                killed.append(victims[0])
                victims[0].signal(signal.SIGKILL)

        runs = [(p, spec) for p in PROMPTS for spec in SPECS]
        results = await asyncio.gather(*(generate(router, p, N, on_first=kill, **spec) for p, spec in runs))
        assert killed, "the kill did not happen"
        for (prompt, spec), (ids, final, err) in zip(runs, results):
            assert err is None, (prompt, spec, err)
            assert ids == greedy(prompt, N), (prompt, spec)
        assert failovers(s, "reopened") >= 1, "no request reopened at the other fusion replica"
        survivor = next(f for f in fusions if f is not killed[0])
        assert survivor.popen.poll() is None and killed[0].popen.poll() is not None
        # fixed depth, so no looked-up tokens: under adaptive speculation the tiny target, which repeats
        # itself, can finish 16 tokens by lookup in plain steps before the first draft comes back
        ids, final, err = await generate(router, PROMPTS[0], 16, speculation={
            "drafters": ["ngram"], "adaptive_depth": False, "max_depth": 3})
        assert err is None and ids == greedy(PROMPTS[0], 16)
        assert final.stats.drafted_tokens > 0, "a new request did not draft at the surviving fusion replica"
    finally:
        await stop(s)
        for f in fusions:
            f.kill()


async def test_the_only_fusion_stopped_then_killed_requests_decode_plainly_identical(tiny_dirs, redis_server, greedy):
    drafter = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
    fusion = fusion_proc(f"127.0.0.1:{drafter.port}").start()
    s = {"drafter": drafter}
    try:
        s.update(await start(tiny_dirs, redis_server, [fusion]))
        router = f"127.0.0.1:{s['router'].port}"
        stop_fusion, stopped = on_first(fusion, signal.SIGSTOP)
        runs = [(p, spec) for p in PROMPTS[:2] for spec in SPECS]
        results = await asyncio.gather(*(generate(router, p, N, on_first=stop_fusion, **spec) for p, spec in runs))
        ended = time.perf_counter()
        assert stopped, "the stop did not happen"
        for (prompt, spec), (ids, final, err) in zip(runs, results):
            assert err is None, (prompt, spec, err)
            assert ids == greedy(prompt, N), (prompt, spec)
        # each stream waited one draft deadline at most (3 s for a first round), then decoded plainly
        assert ended - stopped[0] < 3.0 + 5.0, f"streams took {ended - stopped[0]:.1f} s after fusion stopped"
        assert failovers(s, "plain") >= 1
        # a new request while fusion is hung, then while it is dead: plain decoding, at once
        for sig in (None, signal.SIGKILL):
            if sig is not None:
                fusion.signal(sig)
                fusion.popen.wait(timeout=10)
            started = time.perf_counter()
            ids, final, err = await generate(router, PROMPTS[2], 24, speculation={"drafters": ["ngram"]})
            assert err is None, err
            assert ids == greedy(PROMPTS[2], 24)
            assert time.perf_counter() - started < 3.0 + 2.0
    finally:
        await stop(s)
        fusion.kill()


async def test_a_request_decoding_plainly_drafts_again_once_fusion_is_back(tiny_dirs, redis_server, greedy):
    """The only fusion stops (SIGSTOP) under a long stream once it drafted, and resumes (SIGCONT) once the
    request fell back to plain decoding past the draft deadline: fusion_retry_s after it lost fusion, with the
    replica's health check passing again, the request reopens there and drafts for the rest of its tokens;
    identical. The signals follow the scheduler's own counters, not the clock, so a fast machine that runs the
    440 tokens in under two seconds still sees every step."""
    import threading

    drafter = await serve_drafter(DrafterSettings(name="ngram", kind="ngram", **COMMON))
    fusion = fusion_proc(f"127.0.0.1:{drafter.port}").start()
    s = {"drafter": drafter}
    try:
        # lookup off: the tiny target repeats itself, so looked-up tokens let its plain decoding outrun
        # fusion_retry_s (440 tokens in 0.28 s in a clean clone), and this test is about drafting again
        s.update(await start(tiny_dirs, redis_server, [fusion], draft_deadline_s=0.1, fusion_retry_s=0.15,
                             lookup_tokens=0))
        router = f"127.0.0.1:{s['router'].port}"
        registry = s["scheduler"].metrics.registry
        times: dict[str, float] = {}
        done = threading.Event()

        def signals():  # a request's first round is plain, its first draft has the long first-draft deadline
            def wait(until) -> bool:
                while not until():
                    if done.wait(0.005):
                        return False
                return True
            if wait(lambda: (registry.get_sample_value("cosine_scheduler_drafted_tokens_total") or 0) > 0):
                fusion.signal(signal.SIGSTOP)
                times["stopped"] = time.perf_counter()
                if wait(lambda: failovers(s, "plain") >= 1):
                    times["plain"] = time.perf_counter()
            fusion.signal(signal.SIGCONT)
            times["resumed"] = time.perf_counter()
            if wait(lambda: failovers(s, "reopened") >= 1):
                times["reopened"] = time.perf_counter()

        watcher = threading.Thread(target=signals, daemon=True)
        prompt, n = PROMPTS[2], 440
        started = time.perf_counter()
        watcher.start()
        ids, final, err = await generate(router, prompt, n, speculation={"drafters": ["ngram"]})
        ended = time.perf_counter()
        done.set()
        watcher.join(timeout=5)
        seen = {k: round(v - started, 2) for k, v in times.items()} | {"ended": round(ended - started, 2)}
        assert err is None, err
        assert ids == greedy(prompt, n)
        assert "stopped" in times, f"fusion never drafted for the request: {seen}"
        assert failovers(s, "plain") >= 1, f"the stop did not reach a draft: {seen}"
        assert failovers(s, "reopened") >= 1, f"the request never drafted again: {seen}"
    finally:
        await stop(s)
        fusion.signal(signal.SIGCONT)
        fusion.kill()
