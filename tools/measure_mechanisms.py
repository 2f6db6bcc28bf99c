"""Measure two of issue 5's figures on the local cluster with the real target and the built zoo.

1. Routing: with routing on (the full system, every drafter a candidate), which drafters the
   scheduler selects for each domain's held-out prompts, one request at a time so the counters'
   change belongs to that domain: the first round's choice from the prompt prior
   (`cosine_scheduler_routing_first_choice_total`), and per drafting round
   (`cosine_scheduler_drafter_selected_total` over rounds with depth > 0). Reported: the share of
   requests whose first specialist choice is the domain's own, the share of drafting rounds the
   domain's specialist drafts in, and its share of all specialist (lm-*) selections.
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


def selected(port: int) -> dict[str, dict[str, float]]:
    """{"rounds": {drafter: rounds selected}, "first": {drafter: first choices}, "drafting": {"rounds": n}}."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[str, float]] = {"rounds": {}, "first": {}, "drafting": {"rounds": 0.0}}
    count = zero = 0.0
    for line in body.splitlines():
        for prefix, key in (("cosine_scheduler_drafter_selected_total{", "rounds"),
                            ("cosine_scheduler_routing_first_choice_total{", "first")):
            if line.startswith(prefix):
                name = line.split('drafter="', 1)[1].split('"', 1)[0]
                out[key][name] = float(line.rsplit(" ", 1)[1])
        if line.startswith("cosine_scheduler_depth_count "):
            count = float(line.rsplit(" ", 1)[1])
        if line.startswith('cosine_scheduler_depth_bucket{le="0.0"}'):
            zero = float(line.rsplit(" ", 1)[1])
    out["drafting"]["rounds"] = count - zero
    return out


def delta(after: dict, before: dict) -> dict:
    return {key: {n: v - before[key].get(n, 0.0) for n, v in values.items()} for key, values in after.items()}


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
    parser.add_argument("--skip-fusion", action="store_true", help="measure routing only")
    parser.add_argument("--routing-single", action="store_true",
                        help="routing pass with fusion single: one drafter per round, the best-scored (or the one explored)")
    args = parser.parse_args()
    spec = ClusterSpec(router_port=free_port())
    names = [d.name for d in spec.drafters]
    prompts = {d: domain_split(d, 0, work_dir())[1][: args.prompts] for d in DOMAINS}
    cluster = Cluster(spec)
    cluster.start()
    result = {"routing": {}, "fusion": {}}
    try:
        port = next(p for p in cluster.processes if p.name == "scheduler").metrics_port
        bar = tqdm(total=len(DOMAINS) * args.prompts * (1 if args.skip_fusion else 4), desc="mechanisms", unit="request")
        for domain in DOMAINS:
            specialist = f"lm-{domain}"
            before = selected(port)
            for p in prompts[domain]:
                run(cluster.router_address, p, args.max_new_tokens,
                    {"fusion": common_pb2.FUSION_MODE_SINGLE} if args.routing_single else None)
                bar.update(1)
            result["routing"][domain] = delta(selected(port), before)
            if args.skip_fusion:
                continue
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
        r = result["routing"][domain]
        own = f"lm-{domain}"
        firsts = {n: c for n, c in r["first"].items() if c}
        lm_rounds = sum(c for n, c in r["rounds"].items() if n.startswith("lm-"))
        drafting = r["drafting"]["rounds"] or 1
        summary = {
            "first_choice_own": r["first"].get(own, 0) / args.prompts,  # requests whose first round included it
            "rounds_with_own": r["rounds"].get(own, 0) / drafting,
            "own_share_of_specialist_selections": r["rounds"].get(own, 0) / max(lm_rounds, 1),
        }
        r["summary"] = summary
        shares = ", ".join(f"{n} {c / drafting:.0%}" for n, c in sorted(r["rounds"].items(), key=lambda kv: -kv[1]) if c)
        print(f"{domain:9} first round's drafters (prior), over {args.prompts} requests: {firsts}")
        print(f"{'':9} rounds each drafter drafted in: {shares}")
        print(f"{'':9} own specialist: in the first round of {summary['first_choice_own']:.0%} of requests, in {summary['rounds_with_own']:.0%} of "
              f"drafting rounds, {summary['own_share_of_specialist_selections']:.0%} of specialist selections")
        if domain in result["fusion"]:
            print(f"{'':9} accepted per round (depth 4): " + ", ".join(f"{k} {v:.2f}" for k, v in result["fusion"][domain].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
