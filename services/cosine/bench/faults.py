"""cosine bench faults: fault scenarios against a local cluster this command starts, as a table.

Scenarios (real processes, real signals):
  fault-free                 the reference: each prompt once, greedy, nothing broken
  overload                   --concurrency streams at once (more than the router admits): each must end
                             OK (identical) or RESOURCE_EXHAUSTED within 100 ms
  drafters SIGKILLed         every drafter process SIGKILLed --kill-after-s into the streams
  every drafter dead         new requests after that (plain decoding needs no drafter)
  scheduler SIGKILLed        the scheduler holding most streams SIGKILLed --kill-after-s into them: the
                             router resumes them on another (the cluster runs --schedulers, default 3)
  scheduler SIGTERMed        the same with SIGTERM: it drains, hands its streams over, and exits
  fusion SIGKILLed           the (only) fusion process SIGKILLed --kill-after-s into the streams: they
                             decode plainly from there
  fusion dead                new requests after that

Per scenario: requests, completed, identical to the fault-free output, errors by status, the
slowest refusal, and the added latency (median latency minus the fault-free median; with every
drafter gone the requests decode plainly, which can be faster than speculation, so it can be
negative). The scheduler scenarios also give how many streams the fault hit (the signalled scheduler held
them), the p99 over streams of each one's longest pause between chunks minus the longest pause of
its prompt without a fault (the added latency of a failover, as the client sees it), and how many the router resumed (SIGTERM: the scheduler lets its streams
finish for --handover-after-s, here 0.5 s, then hands the rest over). Exit status 1 when a stream was not identical, ended with a status other
than RESOURCE_EXHAUSTED, or was refused after more than 100 ms, or a scheduler fault hit no stream.
Verifier and Redis faults are not scenarios here (tests/faults/ has them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import grpc

from cosine.bench.client import metric_sum, scrape
from cosine.bench.prompts import PROMPTS, Prompt
from cosine.router.v1 import router_pb2, router_pb2_grpc


@dataclass
class Outcome:
    prompt: int
    code: str = "OK"
    token_ids: list[int] = field(default_factory=list)
    seconds: float = 0.0  # to the end of the stream, or to the error
    ended: float = 0.0  # time.monotonic() at the end
    max_gap_s: float = 0.0  # the longest pause between two chunks (a failover shows here)


@dataclass
class Row:
    scenario: str
    requests: int
    completed: int
    identical: int
    errors: dict[str, int]
    slowest_refusal_ms: float | None
    added_latency_s: float | None
    refusal_p50_ms: float | None = None
    refusal_p99_ms: float | None = None
    hit: int | None = None  # streams the fault hit (the signalled scheduler held them), where it counts them
    added_p99_s: float | None = None  # p99 over streams of the longest pause minus the same prompt's fault-free one


async def one(stub, prompt: Prompt, index: int, max_new: int, timeout: float, on_first=None) -> Outcome:
    out = Outcome(index)
    started = time.perf_counter()
    last = None
    try:
        async for reply in stub.Generate(router_pb2.GenerateRequest(**prompt.request_fields(max_new)), timeout=timeout):
            if reply.WhichOneof("kind") == "chunk":
                now = time.perf_counter()
                if last is not None:
                    out.max_gap_s = max(out.max_gap_s, now - last)
                last = now
                if not out.token_ids and on_first is not None:
                    on_first()
                out.token_ids += reply.chunk.token_ids
    except grpc.aio.AioRpcError as exc:
        out.code = exc.code().name
    out.seconds = time.perf_counter() - started
    out.ended = time.monotonic()
    return out


def run_many(address: str, prompts: list[Prompt], indices: list[int], max_new: int, timeout: float, on_first=None) -> list[Outcome]:
    """Every stream at once from one event loop (a thread per stream would time the client's threads)."""
    async def go():
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = router_pb2_grpc.RouterStub(channel)
            return await asyncio.gather(*(one(stub, prompts[i], i, max_new, timeout, on_first) for i in indices))
    return asyncio.run(go())


def row(name: str, outcomes: list[Outcome], reference: dict[int, list[int]], base_median: float | None,
        base_gaps: dict[int, float] | None = None, hit: int | None = None) -> Row:
    ok = [o for o in outcomes if o.code == "OK"]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.code != "OK":
            errors[o.code] = errors.get(o.code, 0) + 1
    refused = [o.seconds for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    added = statistics.median(o.seconds for o in ok) - base_median if ok and base_median is not None else None
    refused.sort()
    def pct(q):
        return refused[min(len(refused) - 1, int(q * len(refused)))] * 1000 if refused else None
    added_p99 = None
    if base_gaps and ok:  # each stream's longest pause against the longest pause of its prompt without a fault
        each = sorted(o.max_gap_s - base_gaps[o.prompt] for o in ok if o.prompt in base_gaps)
        added_p99 = each[min(len(each) - 1, int(0.99 * len(each)))] if each else None
    return Row(name, len(outcomes), len(ok), sum(o.token_ids == reference.get(o.prompt) for o in ok), errors,
               max(refused) * 1000 if refused else None, added, pct(0.5), pct(0.99), hit, added_p99)


def table(rows: list[Row]) -> str:
    lines = [f"{'scenario':24} {'requests':>8} {'completed':>9} {'identical':>9} {'refusal p50/p99/max':>20} {'added latency':>13} "
             f"{'hit':>4} {'added p99':>9}  errors"]
    for r in rows:
        refusal = (f"{r.refusal_p50_ms:.0f}/{r.refusal_p99_ms:.0f}/{r.slowest_refusal_ms:.0f} ms"
                   if r.slowest_refusal_ms is not None else "-")
        added = f"{r.added_latency_s:+.2f} s" if r.added_latency_s is not None else "-"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "none"
        hit = "-" if r.hit is None else str(r.hit)
        p99 = f"{r.added_p99_s:+.2f} s" if r.added_p99_s is not None else "-"
        lines.append(f"{r.scenario:24} {r.requests:>8} {r.completed:>9} {r.identical:>9} {refusal:>20} {added:>13} {hit:>4} {p99:>9}  {errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cosine bench faults", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="", help="target model directory or zoo name (default: the zoo's target)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per scenario (from the benchmark prompt set)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=48, help="streams at once in the overload scenario")
    ap.add_argument("--kill-after-s", type=float, default=1.0, help="when the drafters or a scheduler are signalled, after the first token")
    ap.add_argument("--handover-after-s", type=float, default=0.5, help=(
        "the schedulers' --handover-after-s: how long a SIGTERMed one lets its streams finish before it hands them over"))
    ap.add_argument("--failover-streams", type=int, default=8, help="streams at once in the scheduler scenarios (the prompts in turn)")
    ap.add_argument("--schedulers", type=int, default=3, help="scheduler replicas (the scheduler scenarios need 3: one is killed, one terminated)")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)

    from cosine.cluster import Cluster, ClusterSpec, free_port

    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-bench-faults-")  # never touch a cluster `cosine up` left
    os.environ["COSINE_SCHEDULER_HANDOVER_AFTER_S"] = str(args.handover_after_s)  # the cluster's schedulers read it
    spec = ClusterSpec(router_port=free_port(), target=args.target, log_level="WARNING")
    if args.schedulers > 1:
        spec.replicas = {"scheduler": args.schedulers}
    cluster = Cluster(spec)
    print(f"starting a local cluster (logs in {os.environ['COSINE_RUN_DIR']})...", flush=True)
    cluster.start()
    prompts = PROMPTS[: max(1, min(args.prompts, len(PROMPTS)))]
    n, address, rows = len(prompts), cluster.router_address, []
    try:
        run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s)  # warm-up, not counted
        base = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s)
        reference = {o.prompt: o.token_ids for o in base if o.code == "OK"}
        base_median = statistics.median(o.seconds for o in base if o.code == "OK") if reference else None
        rows.append(row("fault-free", base, reference, base_median))
        print(table(rows[-1:]), flush=True)

        overload = run_many(address, prompts, [i % n for i in range(args.concurrency)], args.max_new_tokens, args.timeout_s)
        rows.append(row(f"overload ({args.concurrency} at once)", overload, reference, base_median))
        print(table(rows[-1:]).splitlines()[-1], flush=True)

        drafters = [p for p in cluster.processes if p.name.startswith("drafter-")]
        kill_later, killed_at = kill_on_first(drafters, args.kill_after_s)
        killed = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s, on_first=kill_later)
        rows.append(row("drafters SIGKILLed", killed, reference, base_median))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        hit = sum(o.ended > killed_at[0] + args.kill_after_s for o in killed) if killed_at else 0
        print(f"  streams still running when the drafters were killed: {hit}/{len(killed)}", flush=True)

        dead = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s)
        rows.append(row("every drafter dead", dead, reference, base_median))
        print(table(rows[-1:]).splitlines()[-1], flush=True)

        schedulers = [p for p in cluster.processes if p.name.startswith("scheduler")]
        if len(schedulers) < 3:
            print("  scheduler scenarios skipped: they need --schedulers 3", flush=True)
        else:
            # the reference again without drafters (they are dead now), each prompt's own latency for the added p99
            plain = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s)
            plain_seconds = {o.prompt: o.seconds for o in plain if o.code == "OK"}
            plain_gaps = {o.prompt: o.max_gap_s for o in plain if o.code == "OK"}
            router = next(p for p in cluster.processes if p.name == "router")
            for name, sig in (("scheduler SIGKILLed", signal.SIGKILL), ("scheduler SIGTERMed", signal.SIGTERM)):
                before = scrape(router.metrics_port)
                victim: list = []

                def signal_later(sig=sig, victim=victim):
                    if not victim:
                        victim.append(None)
                        def go():
                            time.sleep(args.kill_after_s)
                            target, held = busiest([p for p in schedulers if _alive(p.pid)])
                            victim[0] = (target, held)
                            os.kill(target.pid, sig)
                        import threading
                        threading.Thread(target=go, daemon=True).start()

                streams = [i % n for i in range(args.failover_streams)]
                outcomes = run_many(address, prompts, streams, args.max_new_tokens, args.timeout_s, on_first=signal_later)
                after = scrape(router.metrics_port)
                held = victim[0][1] if victim and victim[0] is not None else 0
                rows.append(row(name, outcomes, reference, statistics.median(plain_seconds.values()) if plain_seconds else None,
                                plain_gaps, held))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                resumed = {reason: metric_sum(after, f'cosine_router_resumes_total{{reason="{reason}"}}')
                           - metric_sum(before, f'cosine_router_resumes_total{{reason="{reason}"}}') for reason in ("broken", "handover")}
                gaps = (metric_sum(after, "cosine_router_resume_seconds_count") - metric_sum(before, "cosine_router_resume_seconds_count"))
                gap_s = (metric_sum(after, "cosine_router_resume_seconds_sum") - metric_sum(before, "cosine_router_resume_seconds_sum"))
                print(f"  the signalled scheduler held {held} of the {len(streams)} streams; resumed by the router: {resumed['broken']:.0f} "
                      f"(stream broke), {resumed['handover']:.0f} (handed over); mean gap from the break to the resumed "
                      f"stream's first tokens: {gap_s / gaps:.2f} s" if gaps else
                      f"  the signalled scheduler held {held} of the {len(streams)} streams; none was resumed (they finished while it drained)"
                      if not any(resumed.values()) else f"  resumed: {resumed}", flush=True)
                if victim and victim[0] is not None:
                    schedulers.remove(victim[0][0])

        # fusion last: the cluster runs one, so the requests decode plainly from here on
        fusions = [p for p in cluster.processes if p.name.startswith("fusion")]
        kill_fusion_later, fusion_killed = kill_on_first(fusions, args.kill_after_s)
        outcomes = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s, on_first=kill_fusion_later)
        hit = sum(o.ended > fusion_killed[0] + args.kill_after_s for o in outcomes) if fusion_killed else 0
        rows.append(row("fusion SIGKILLed", outcomes, reference, base_median, hit=hit))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        dead = run_many(address, prompts, list(range(n)), args.max_new_tokens, args.timeout_s)
        rows.append(row("fusion dead", dead, reference, base_median))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        cluster.stop()
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    bad = [r for r in rows if r.identical != r.completed or set(r.errors) - {"RESOURCE_EXHAUSTED"}
           or (r.slowest_refusal_ms or 0) > 100 or r.hit == 0]
    return 1 if bad else 0


def kill_on_first(processes, after_s: float):
    """(an on_first callback that SIGKILLs every one of `processes` `after_s` after the first stream's first
    tokens, in a thread so the client's loop goes on; the list that gets the time of that first call)."""
    import threading

    started: list[float] = []

    def on_first():
        if not started:
            started.append(time.monotonic())

            def kill():
                time.sleep(after_s)
                for p in processes:
                    os.kill(p.pid, signal.SIGKILL)
            threading.Thread(target=kill, daemon=True).start()
    return on_first, started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def busiest(processes):
    """(the scheduler process holding the most live requests by its Load report, how many); the first when none answers."""
    from cosine.common.v1 import common_pb2, common_pb2_grpc

    best, most = processes[0], -1
    for proc in processes:
        try:
            with grpc.insecure_channel(proc.address) as channel:
                live = common_pb2_grpc.LoadStub(channel).Report(common_pb2.LoadRequest(), timeout=2).live_requests
        except grpc.RpcError:
            continue
        if live > most:
            best, most = proc, live
    return best, max(most, 0)


if __name__ == "__main__":
    raise SystemExit(main())
