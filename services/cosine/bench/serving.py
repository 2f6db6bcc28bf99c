"""`cosine bench serving`: the local cluster against `transformers` alone, same prompts, same run.

Systems, run one after another on the same machine (the cluster sits idle while
the baseline runs, and the other way round):

  target-only   transformers generate(), greedy, batch 1, in this process (torch threads = --threads)
  cosine-plain  the cluster with speculation disabled (plain decoding through the verifier)
  cosine-ngram  the cluster drafting with the prompt-lookup drafter
  cosine-lm     the cluster drafting with the zoo's LM drafters (lm-code, lm-docs, ... from
                `cosine zoo build`; the untrained lm-2layer before a build), routed per request
  cosine-zoo    the cluster drafting with all of them, prompt lookup included

Per system: output tokens/s (completion tokens over wall time, summed over prompts),
time to first token (p50), mean tokens committed per round, and how many prompts'
outputs are identical to target-only. For the cluster, where one round's time
goes, from the scheduler's metrics: drafting (fusion + drafters), verification,
the Redis commit, and the gRPC overhead around both calls.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import urllib.request

import grpc
from tqdm.auto import tqdm

from cosine.bench.prompts import PROMPTS
from cosine.router.v1 import router_pb2, router_pb2_grpc

def cluster_systems(drafters: list[str]) -> dict[str, dict]:
    """The cluster's configurations, over the drafters the cluster runs."""
    lms = [d for d in drafters if d != "ngram"]
    return {
        "cosine-plain": {"disabled": True},
        "cosine-ngram": {"drafters": ["ngram"]},
        "cosine-lm": {"drafters": lms},
        "cosine-zoo": {"drafters": ["ngram"] + lms},
    }
ROUND_METRICS = {
    "draft": "cosine_scheduler_draft_seconds",
    "draft_compute": "cosine_scheduler_draft_compute_seconds",
    "verify": "cosine_scheduler_verify_seconds",
    "verify_compute": "cosine_scheduler_verify_compute_seconds",
    "commit": "cosine_scheduler_commit_seconds",
}


def scrape_sums(port: int) -> dict[str, float]:
    """Histogram sums and counts of the scheduler's round metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in body.splitlines():
        if line.startswith("cosine_scheduler_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    out = {}
    for key, metric in ROUND_METRICS.items():
        out[key + "_sum"] = values.get(metric + "_sum", 0.0)
        out[key + "_count"] = values.get(metric + "_count", 0.0)
    out["rounds"] = values.get("cosine_scheduler_rounds_total", 0.0)
    return out


def run_target_only(target_dir, max_new_tokens: int, threads: int, bar) -> list[dict]:
    import torch
    from transformers import AutoTokenizer

    from cosine.engine.models import load_causal_lm

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = load_causal_lm(target_dir)
    results = []
    for prompt in PROMPTS:
        ids = prompt.token_ids(tok)
        x = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(x, max_new_tokens=2, do_sample=False)  # warm-up of this shape
            started = time.perf_counter()
            out = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):].tolist()
            elapsed = time.perf_counter() - started
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id) + 1]
        results.append({"token_ids": out, "elapsed_s": elapsed, "ttft_s": None, "rounds": len(out), "accepted": 0})
        bar.update(1)
    return results


def run_cluster(address: str, speculation: dict, max_new_tokens: int, bar) -> list[dict]:
    results = []
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for prompt in PROMPTS:
            request = router_pb2.GenerateRequest(**prompt.request_fields(max_new_tokens), speculation=speculation)
            started = time.perf_counter()
            first, ids, final = None, [], None
            for reply in stub.Generate(request, timeout=600):
                if reply.WhichOneof("kind") == "chunk":
                    first = first or time.perf_counter()
                    ids += reply.chunk.token_ids
                else:
                    final = reply.final
            elapsed = time.perf_counter() - started
            results.append({"token_ids": ids, "elapsed_s": elapsed, "ttft_s": first - started if first else None,
                            "rounds": final.stats.rounds, "accepted": final.stats.accepted_tokens,
                            "drafted": final.stats.drafted_tokens})
            bar.update(1)
    return results


def summarise(name: str, results: list[dict], reference: list[dict]) -> dict:
    tokens = sum(len(r["token_ids"]) for r in results)
    elapsed = sum(r["elapsed_s"] for r in results)
    rounds = sum(r["rounds"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {
        "name": name,
        "prompts": len(results),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "ttft_ms_p50": statistics.median(ttfts) * 1000 if ttfts else None,
        "mean_committed_per_round": tokens / rounds if rounds else None,
        "mean_accepted_per_round": sum(r["accepted"] for r in results) / rounds if rounds else None,
        "identical_outputs": sum(r["token_ids"] == ref["token_ids"] for r, ref in zip(results, reference)),
    }


def round_breakdown(before: dict, after: dict) -> dict:
    """Mean milliseconds per round of each part, between two scrapes."""
    d = {k: after[k] - before[k] for k in after}
    rounds = d["rounds"] or 1

    def per_round(key):
        return d[key + "_sum"] / rounds * 1000

    draft, draft_compute = per_round("draft"), per_round("draft_compute")
    verify, verify_compute = per_round("verify"), per_round("verify_compute")
    return {
        "rounds": int(d["rounds"]),
        "draft_ms": draft_compute,
        "verify_ms": verify_compute,
        "commit_ms": per_round("commit"),
        "grpc_ms": (draft - draft_compute) + (verify - verify_compute),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cosine bench serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the target-only baseline")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster below is stopped on a kill too

    from cosine.cluster import Cluster, ClusterSpec, free_port
    from cosine.zoo.registry import TARGET, path_of

    target_dir = path_of(TARGET)
    n = len(PROMPTS)
    spec = ClusterSpec(router_port=free_port())
    systems = cluster_systems([d.name for d in spec.drafters])
    bar = tqdm(total=n * (1 + len(systems)), desc="bench serving", unit="prompt", disable=None)
    bar.set_postfix_str("target-only")
    reference = run_target_only(target_dir, args.max_new_tokens, args.threads, bar)
    rows = [summarise("target-only", reference, reference)]
    breakdowns = {}
    cluster = Cluster(spec)
    bar.set_postfix_str("starting the cluster")
    cluster.start()
    try:
        scheduler = next(p for p in cluster.processes if p.name == "scheduler")
        run_cluster(cluster.router_address, {"disabled": True}, 8, _Null())  # warm-up
        for name, speculation in systems.items():
            bar.set_postfix_str(name)
            before = scrape_sums(scheduler.metrics_port)
            results = run_cluster(cluster.router_address, speculation, args.max_new_tokens, bar)
            breakdowns[name] = round_breakdown(before, scrape_sums(scheduler.metrics_port))
            rows.append(summarise(name, results, reference))
    finally:
        cluster.stop()
        bar.close()
    base = rows[0]["tokens_per_s"]
    print(f"\n{n} prompts x {args.max_new_tokens} new tokens, greedy; ratios against target-only in this run\n")
    print(f"{'system':14} {'tok/s':>7} {'ratio':>6} {'TTFT p50':>9} {'tok/round':>9} {'identical':>9} | "
          f"{'draft':>6} {'verify':>6} {'commit':>6} {'gRPC':>6}  ms/round")
    for row in rows:
        b = breakdowns.get(row["name"])
        parts = (f"{b['draft_ms']:6.1f} {b['verify_ms']:6.1f} {b['commit_ms']:6.1f} {b['grpc_ms']:6.1f}" if b else " " * 27)
        ttft = f"{row['ttft_ms_p50']:7.0f}ms" if row["ttft_ms_p50"] is not None else f"{'-':>9}"
        print(f"{row['name']:14} {row['tokens_per_s']:7.1f} {row['tokens_per_s'] / base:5.2f}x {ttft} "
              f"{row['mean_committed_per_round']:9.2f} {row['identical_outputs']:>6}/{row['prompts']} | {parts}")
    if args.json_path:
        for row in rows:
            row["ratio_to_target_only"] = row["tokens_per_s"] / base
            row["round_ms"] = breakdowns.get(row["name"])
        with open(args.json_path, "w") as f:
            json.dump({"max_new_tokens": args.max_new_tokens, "systems": rows}, f, indent=2)
    return 0


class _Null:
    def update(self, n):
        pass


if __name__ == "__main__":
    sys.exit(main())
