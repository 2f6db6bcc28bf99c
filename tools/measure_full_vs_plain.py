"""cosine-full against cosine-plain in one running cluster, block by block, interleaved.

`cosine bench compare` runs each system once per load point, one after another: at c=4 a run of 16 requests
of 64 tokens lasts about 4 s, so the speculation gate's first windows at that load (each mode measured once,
then an exploration every 8 windows of 0.5 s) are a large part of cosine-full's run, and the machine's drift
between the two runs is as large as the difference. This tool starts one cluster (the zoo's drafters and
the verifier's feature head, as the bench does) and sends blocks of the same closed-loop load alternately
with speculation disabled (cosine-plain) and with every mechanism on (cosine-full): the sides see the same
minutes, and cosine-full's gate keeps what it learnt from one block to the next, as a serving system's
would. Per block: tokens/s, tokens per verification step, drafted and looked-up tokens, where a step's time goes (as
`cosine bench compare` reports it), each process's CPU seconds, and whether every output equals the plain
block's.

    PYTHONPATH=services python tools/measure_full_vs_plain.py --concurrency 4 --blocks 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def cpu_seconds(procs: dict) -> dict[str, float]:
    """User + system CPU seconds each cluster process has used so far (from /proc; 0 where unreadable)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, proc in procs.items():
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            out[name] = 0.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--blocks", type=int, default=4, help="blocks per side (plain, full, plain, full, ...)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--workload", choices=["zoo", "unlike"], default="unlike")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sides", default="cosine-plain,cosine-full",
                   help="the systems of each block, in order (one of them alone: to profile its processes)")
    args = p.parse_args()
    if not set(args.sides.split(",")) <= {"cosine-plain", "cosine-full"}:
        p.error(f"--sides takes cosine-plain and/or cosine-full, not {args.sides!r}")

    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-ab-run-")
    slots = str(max(16, args.concurrency + 8))
    os.environ["COSINE_VERIFIER_MAX_SLOTS"] = os.environ["COSINE_DRAFTER_MAX_REQUESTS"] = slots
    os.environ["COSINE_ROUTER_MAX_STREAMS"] = slots
    os.environ.setdefault("COSINE_VERIFIER_MAX_CONTEXT", "2048")
    os.environ["COSINE_VERIFIER_DTYPE"] = os.environ["COSINE_DRAFTER_DTYPE"] = args.dtype
    os.environ.setdefault("COSINE_DRAFTER_MEMORY_TOKENS", "0")  # the blocks repeat their prompts

    from cosine.bench import client
    from cosine.bench.compare import cluster_snapshot, cluster_speculation, step_breakdown
    from cosine.bench.workload import build_workload
    from cosine.cluster import Cluster, ClusterSpec, free_port, zoo_drafters
    from cosine.zoo.registry import cache_root
    from cosine.common.v1 import common_pb2 as c

    workload = build_workload(2, 0, cache_root(), source=args.workload)
    order = list(range(len(workload)))
    spec = ClusterSpec(router_port=free_port(), drafters=zoo_drafters())
    speculation = cluster_speculation("", 4)
    sides = {name: speculation[name] for name in args.sides.split(",")}
    cluster = Cluster(spec)
    rates: dict[str, list[float]] = {name: [] for name in sides}  # tokens/s of each block
    reference: dict[int, list[int]] = {}
    identical = {name: 0 for name in sides}
    try:
        cluster.start()
        warm = [{"disabled": True}, {"drafters": [d.name for d in spec.drafters], "fusion": c.FUSION_MODE_MERGE, "max_depth": 2}]
        for w in warm:
            client.closed_loop(cluster.router_address, workload, [0], w, 1, 8)
        print(f"{len(workload)} prompts ({args.workload}), {args.max_new_tokens} new tokens, c={args.concurrency}, "
              f"{args.dtype}; blocks interleaved, same cluster", flush=True)
        procs = {p.name: p for p in cluster.processes}
        ports = (procs["verifier"].metrics_port, [p.metrics_port for n, p in procs.items() if n.startswith("drafter-")],
                 procs["scheduler"].metrics_port)
        print(f"{'block':>5} {'system':<13} {'tok/s':>7} {'tok/step':>8} {'drafted':>8} {'accepted':>8} {'errors':>6} "
              f"{'steps':>6} {'batch':>6} {'wall/st':>7} {'verify':>7} {'model':>6} {'grpc+q':>6} {'between':>7}  "
              f"CPU s per process", flush=True)
        for block in range(args.blocks):
            for name, spec_dict in sides.items():
                before, cpu0 = cluster_snapshot(*ports), cpu_seconds(procs)
                records, wall = client.closed_loop(cluster.router_address, workload, order, spec_dict, args.concurrency,
                                                   args.max_new_tokens)
                after, cpu1 = cluster_snapshot(*ports), cpu_seconds(procs)
                st = step_breakdown(before, after, wall) or {}
                cpu = " ".join(f"{n}={cpu1[n] - cpu0[n]:.1f}" for n in cpu1 if cpu1[n] - cpu0[n] >= 0.05)
                tokens = sum(len(r.token_ids) for r in records)
                errors = sum(1 for r in records if r.error)
                drafted = sum(r.drafted for r in records)
                accepted = sum(r.accepted for r in records)
                for r in records:
                    if name == "cosine-plain" and r.prompt_index not in reference:
                        reference[r.prompt_index] = r.token_ids
                    identical[name] += int(reference.get(r.prompt_index) == r.token_ids)
                steps = tokens - accepted
                rates[name].append(tokens / wall)
                print(f"{block + 1:>5} {name:<13} {tokens / wall:7.1f} {tokens / max(1, steps):8.2f} {drafted:8d} "
                      f"{accepted:8d} {errors:6d} {st.get('steps', 0):6d} {st.get('mean_batch', 0):6.2f} "
                      f"{st.get('wall_per_step_ms', 0):7.2f} {st.get('verifier_step_ms', 0):7.2f} "
                      f"{st.get('verifier_model_ms', 0):6.2f} {st.get('grpc_queue_ms', 0):6.2f} "
                      f"{st.get('between_steps_ms', 0):7.2f}  {cpu}", flush=True)
    finally:
        cluster.stop()
    if set(sides) != {"cosine-plain", "cosine-full"}:
        return 0
    plain, full = rates["cosine-plain"], rates["cosine-full"]
    ratios = [f / p for f, p in zip(full, plain)]
    print(f"\ncosine-full / cosine-plain by block: {' '.join(f'{x:.2f}' for x in ratios)}; "
          f"mean {statistics.mean(ratios):.3f}, without the first block "
          f"{statistics.mean(ratios[1:]) if len(ratios) > 1 else float('nan'):.3f}")
    n = len(workload) * args.blocks
    print(f"identical to the first plain block: cosine-plain {identical['cosine-plain']}/{n}, "
          f"cosine-full {identical['cosine-full']}/{n}")
    return 0 if identical["cosine-full"] == n else 1


if __name__ == "__main__":
    sys.exit(main())
