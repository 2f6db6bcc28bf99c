"""Fusion's online calibration on and off, side by side: tokens committed per round and each drafter's
calibration error, through a local cluster on the real target.

Two clusters in turn (Redis, the five services, the zoo's target; the default drafters), the same
requests on each, one at a time, greedy: every drafter named, confidence fusion, fixed depth (no
routing, no adaptive depth), so the tree depends only on what the drafters propose and how fusion
ranks it. Pass 1 (tools/measure_suffix.py's `pass1` prompts) warms both — calibration learns there,
the suffix drafter's memory fills — and pass 2 (`pass2`: other prompts of the same domains, written
before any measuring) is measured. Outputs must be identical between the two clusters (calibration
changes drafts, never output).

    PYTHONPATH=services python tools/measure_calibration.py [--new-tokens 64] [--depth 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_suffix import PROMPTS, serve_one  # noqa: E402 - the prompt sets written for the suffix measurement


def run(calibrate: bool, new_tokens: int, depth: int, outputs: dict) -> dict:
    import grpc

    from cosine.bench.client import metric_sum, scrape
    from cosine.cluster import Cluster, ClusterSpec, free_port
    from cosine.common.v1 import common_pb2
    from cosine.router.v1 import router_pb2_grpc

    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-calibration-")
    os.environ["COSINE_FUSION_CALIBRATE"] = "true" if calibrate else "false"
    cluster = Cluster(ClusterSpec(router_port=free_port(), log_level="WARNING"))
    print(f"calibration {'on' if calibrate else 'off'}: starting a local cluster...", flush=True)
    cluster.start()
    drafters = [p.name.removeprefix("drafter-") for p in cluster.processes if p.name.startswith("drafter-")]
    ports = {p.name: p.metrics_port for p in cluster.processes}
    out = {"calibrate": calibrate, "drafters": drafters}
    try:
        with grpc.insecure_channel(cluster.router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for p in ("pass1", "pass2"):
                before = scrape(ports["scheduler"])
                tokens = rounds = accepted = 0
                t = time.perf_counter()
                for i, (_, chat, text) in enumerate(PROMPTS[p]):
                    ids, final = serve_one(stub, chat, text, new_tokens, dict(
                        drafters=drafters, max_depth=depth, fusion=common_pb2.FUSION_MODE_CONFIDENCE, routing=False,
                        adaptive_depth=False))
                    outputs.setdefault((p, i), ids)
                    if outputs[(p, i)] != ids:
                        raise AssertionError(f"{p} prompt {i}: the output differs between calibration on and off")
                    tokens += final.usage.completion_tokens
                    rounds += final.stats.rounds
                    accepted += final.stats.accepted_tokens
                    print(f"  {p} {i + 1}/{len(PROMPTS[p])}", flush=True)
                after = scrape(ports["scheduler"])
                drafted = (metric_sum(after, "cosine_scheduler_drafted_tokens_total")
                           - metric_sum(before, "cosine_scheduler_drafted_tokens_total"))
                out[p] = {"per_round": tokens / max(rounds, 1), "accepted_per_round": accepted / max(rounds, 1),
                          "accepted_share": accepted / max(drafted, 1), "wall_s": time.perf_counter() - t}
            fusion = scrape(ports["fusion"])
            out["ece"] = {d: {w: fusion.get(f'cosine_fusion_drafter_calibration_error{{drafter="{d}",probabilities="{w}"}}')
                              for w in ("stated", "used")} for d in drafters}
            out["observed"] = {d: fusion.get(f'cosine_fusion_drafter_calibration_observations{{drafter="{d}"}}') for d in drafters}
    finally:
        cluster.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    args = ap.parse_args(argv)
    outputs: dict = {}
    results = [run(c, args.new_tokens, args.depth, outputs) for c in (False, True)]
    print(f"\nconfidence fusion over every drafter, depth {args.depth}, {args.new_tokens} tokens, one request at a time:")
    print("calibration | pass  | tokens per round | accepted per round | drafted accepted | wall s")
    for r in results:
        for p in ("pass1", "pass2"):
            m = r[p]
            print(f"{'on' if r['calibrate'] else 'off':<11} | {p} | {m['per_round']:16.3f} | {m['accepted_per_round']:18.3f} | "
                  f"{m['accepted_share']:16.3f} | {m['wall_s']:6.1f}")
    print("\ncalibration error (ECE) per drafter at the end, as stated / as fusion used them (observations):")
    for r in results:
        cells = ", ".join(f"{d} {(r['ece'][d]['stated'] or 0):.2f}/{(r['ece'][d]['used'] or 0):.2f} ({r['observed'][d] or 0:.0f})"
                          for d in r["drafters"])
        print(f"  calibration {'on ' if r['calibrate'] else 'off'}: {cells}")
    print("every output identical with calibration on and off")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
