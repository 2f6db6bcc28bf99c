"""`cosine plan`: how many drafter nodes per verifier, at what request rate speculation stops paying, what a
slower link costs — answered by a discrete-event simulation that runs the scheduler service's own code.

  cosine plan [SCENARIO]            simulate a scenario file (default: the shipped paper set-up,
                                    16 drafter nodes on 100 Mbps links, a 4xA100 verifier on 10 Gbps)
                                    against vanilla speculative decoding at equal cost
  cosine plan --sweep               also sweep drafter nodes per verifier, request rate, link
                                    speed and latency: plots (throughput and TPOT against each), a
                                    recommendation table
  cosine plan --validate            run the local cluster and the simulator on the same workload at
                                    concurrency 1, 4, 8 and print both side by side (--quick: fewer,
                                    shorter requests; a few minutes)
  --json PATH                       write the report (validation: a `validation` list, one entry per
                                    concurrency: concurrency, measured_tokens_per_s,
                                    simulated_tokens_per_s, TTFT/TPOT p50 of both) and plots next to it

The simulation (cosine/plan/sim.py) drives the scheduler service's class (SchedulerServicer: its
plan, expertise routing, adaptive depth, the global controller) and its StepLoop (batch choice,
waiting for drafts, pipelining) on a simulated clock (cosine/plan/simloop.py); only fusion, the
drafters, the verifier, Redis and the links are simulated, by cost models (cosine/plan/costs.py:
fitted from a local cluster's metrics, or the hardware profiles of cosine/plan/profiles.json) and
recorded acceptance traces (cosine/plan/traces.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCENARIOS = Path(__file__).with_name("scenarios")


def build_args(argv):
    p = argparse.ArgumentParser(prog="cosine plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="?", default=str(SCENARIOS / "paper.json"), help="scenario file (default: the paper's set-up)")
    p.add_argument("--validate", action="store_true", help="measure the local cluster and simulate it, side by side")
    p.add_argument("--sweep", action="store_true", help="sweep drafter nodes, request rate and link speed (plots, table)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here (plots next to it)")
    p.add_argument("--concurrency", default="1,4,8", help="validation: closed-loop concurrencies (default 1,4,8)")
    p.add_argument("--per-domain", type=int, default=None, help="validation: prompts per domain (default 2; quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="validation: new tokens per request (default 48; quick 32)")
    p.add_argument("--trace-depth", type=int, default=8, help="validation: the depth acceptance traces are recorded at")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.per_domain = args.per_domain or (1 if args.quick else 2)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 48)
    return args


def main(argv: list[str] | None = None) -> int:
    args = build_args(argv)
    from cosine.common.progress import Progress

    if args.validate:
        from cosine.plan import validate

        with Progress("cosine plan --validate", expected_s=300 if args.quick else 600) as progress:
            doc = validate.run(args, progress)
        doc["command"] = "cosine plan " + " ".join(argv if argv is not None else sys.argv[1:])
        print(validate.format_table(doc))
    else:
        from cosine.plan import scenario

        with Progress("cosine plan", expected_s=120 if args.sweep else 20) as progress:
            doc = scenario.run(Path(args.scenario), args, progress)
        doc["command"] = "cosine plan " + " ".join(argv if argv is not None else sys.argv[1:])
        print(scenario.format_report(doc))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not args.validate and doc.get("sweep"):
            from cosine.plan import scenario

            doc["plots"] = scenario.plot(doc, path.with_name(path.stem + "_sweep.png"))
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
