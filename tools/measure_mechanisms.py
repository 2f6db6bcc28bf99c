"""Measure two of issue 5's figures on the local cluster with the real target and the built zoo.

1. Routing: with routing on (the full system, every drafter a candidate), which drafters the
   scheduler selects for each domain's held-out prompts (`cosine_scheduler_drafter_selected_total`,
   one request at a time, so the counter's change belongs to that domain).
2. Fusion: mean accepted draft tokens per drafting round with confidence fusion of prompt lookup and
   the domain's specialist, against each of them alone (fusion single), fixed depth 4, greedy.

Usage: python tools/measure_mechanisms.py [--prompts 5] [--max-new-tokens 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

from cosine.client import GenerateOptions, build_request
from cosine.cluster import Cluster, ClusterSpec, free_port
from cosine.common.v1 import common_pb2
from cosine.zoo.build import work_dir
from cosine.zoo.corpora import DOMAINS, domain_split


def selected(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("cosine_scheduler_drafter_selected_total{"):
            name = line.split('drafter="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run(address: str, prompt, max_new: int, speculation: dict | None) -> dict:
    import grpc

    from cosine.router.v1 import router_pb2_grpc

    request = build_request(prompt.text, GenerateOptions(max_new_tokens=max_new, chat=prompt.chat))
    for key, value in (speculation or {}).items():
        if key == "drafters":
            request.speculation.drafters.extend(value)
        else:
            setattr(request.speculation, key, value)
    final = None
    with grpc.insecure_channel(address) as channel:
        for reply in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=600):
            if reply.WhichOneof("kind") == "final":
                final = reply.final
    s = final.stats
    return {"rounds": s.rounds, "drafted": s.drafted_tokens, "accepted": s.accepted_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=5, help="held-out prompts per domain")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    spec = ClusterSpec(router_port=free_port())
    names = [d.name for d in spec.drafters]
    prompts = {d: domain_split(d, 0, work_dir())[1][: args.prompts] for d in DOMAINS}
    cluster = Cluster(spec)
    cluster.start()
    result = {"routing": {}, "fusion": {}}
    try:
        port = next(p for p in cluster.processes if p.name == "scheduler").metrics_port
        bar = tqdm(total=len(DOMAINS) * args.prompts * 4, desc="mechanisms", unit="request")
        for domain in DOMAINS:
            specialist = f"lm-{domain}"
            before = selected(port)
            for p in prompts[domain]:
                run(cluster.router_address, p, args.max_new_tokens, None)
                bar.update(1)
            after = selected(port)
            counts = {n: after.get(n, 0) - before.get(n, 0) for n in names}
            result["routing"][domain] = counts
            rows = {}
            for label, speculation in (
                ("fused ngram+" + specialist, {"drafters": ["ngram", specialist], "fusion": common_pb2.FUSION_MODE_CONFIDENCE}),
                ("ngram", {"drafters": ["ngram"], "fusion": common_pb2.FUSION_MODE_SINGLE}),
                (specialist, {"drafters": [specialist], "fusion": common_pb2.FUSION_MODE_SINGLE}),
            ):
                speculation |= {"adaptive_depth": False, "pipelining": False, "max_depth": 4}
                total = {"rounds": 0, "drafted": 0, "accepted": 0}
                for p in prompts[domain]:
                    for k, v in run(cluster.router_address, p, args.max_new_tokens, speculation).items():
                        total[k] += v
                    bar.update(1)
                rows[label] = round(total["accepted"] / max(total["rounds"], 1), 3)
            result["fusion"][domain] = rows
        bar.close()
    finally:
        cluster.stop()
    for domain in DOMAINS:
        counts = result["routing"][domain]
        rounds = sum(counts.values()) or 1
        shares = ", ".join(f"{n} {c / rounds:.0%}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c)
        print(f"{domain:9} routing selections: {shares}")
        print(f"{'':9} accepted per round (depth 4): " + ", ".join(f"{k} {v:.2f}" for k, v in result["fusion"][domain].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
