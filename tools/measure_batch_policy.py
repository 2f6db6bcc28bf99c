"""Output tokens/s of the local cluster under each verifier batch policy (fifo vs objective), closed loop.

    python tools/measure_batch_policy.py --concurrency 8,16 --max-new-tokens 32 --repeats 1

One cluster per (policy, repeat), started with COSINE_VERIFIER_BATCH_POLICY and stopped before the next, the
policies alternating so drift on a shared machine hits both; speculation as `cosine bench compare`'s
cosine-full. Prints one JSON line per load point and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from cosine.bench import client
from cosine.bench.compare import cluster_speculation
from cosine.bench.stats import request_order
from cosine.bench.workload import build_workload
from cosine.cluster import Cluster, ClusterSpec, free_port, zoo_drafters
from cosine.zoo.registry import cache_root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="8,16")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=2, help="requests per client at each load point")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--policies", default="fifo,objective")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    workload = build_workload(2, 0, cache_root())
    drafters = zoo_drafters()
    speculation = cluster_speculation([d.name for d in drafters if d.kind == "lm"][0], 4)["cosine-full"]
    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-batch-policy-")
    os.environ["COSINE_VERIFIER_MAX_SLOTS"] = os.environ["COSINE_DRAFTER_MAX_REQUESTS"] = str(max(levels) + 8)
    os.environ.setdefault("COSINE_VERIFIER_MAX_CONTEXT", "2048")
    results: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        policies = args.policies.split(",")
        for policy in policies if rep % 2 == 0 else policies[::-1]:
            os.environ["COSINE_VERIFIER_BATCH_POLICY"] = policy
            cluster = Cluster(ClusterSpec(router_port=free_port(), drafters=drafters))
            cluster.start()
            try:
                client.closed_loop(cluster.router_address, workload, [0, 1], speculation, 2, 8)  # warm-up
                port = next(p.metrics_port for p in cluster.processes if p.name == "verifier")
                for c in levels:
                    before = client.scrape(port)
                    order = request_order(len(workload), c * args.per_client)
                    records, wall = client.closed_loop(cluster.router_address, workload, order, speculation, c,
                                                       args.max_new_tokens)
                    tokens = sum(len(r.token_ids) for r in records)
                    errors = sum(1 for r in records if r.error)
                    tps = tokens / wall
                    after = client.scrape(port)
                    moved = {k: after.get(f"cosine_verifier_{k}", 0.0) - before.get(f"cosine_verifier_{k}", 0.0)
                             for k in ("batch_size_sum", "batch_size_count", "batch_tokens_sum", "batch_deferred_sum",
                                       "trees_trimmed_total")}
                    steps = moved["batch_size_count"] or 1.0
                    verifier = {"steps": int(moved["batch_size_count"]), "mean_batch": round(moved["batch_size_sum"] / steps, 2),
                                "mean_tokens": round(moved["batch_tokens_sum"] / steps, 1),
                                "deferred": int(moved["batch_deferred_sum"]), "trimmed": int(moved["trees_trimmed_total"])}
                    results.setdefault((policy, c), []).append(tps)
                    print(json.dumps({"policy": policy, "concurrency": c, "repeat": rep, "tokens": tokens,
                                      "wall_s": round(wall, 2), "tokens_per_s": round(tps, 2), "errors": errors, "verifier": verifier}), flush=True)
            finally:
                cluster.stop()
    for (policy, c), v in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"c={c:<3} {policy:<10} tokens/s " + " ".join(f"{x:.1f}" for x in v) + f"  (mean {statistics.mean(v):.1f})")


if __name__ == "__main__":
    main()
