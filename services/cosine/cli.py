"""The `cosine` command: prepare models, run the local cluster, stream generations."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

EPILOG = """examples:
  cosine zoo                          prepare the default models (first run: about a minute)
  cosine zoo build                    distil a drafter per domain from the target (default budget: 20 minutes)
  cosine zoo eval --json zoo.json     every drafter on every domain's held-out prompts: tau, c, predicted speedup
  cosine zoo head                     retrain the verifier's feature head on the build's data (the build trains one)
  cosine up                           start the local cluster; Ctrl-C stops it
  cosine up --detach && cosine generate --chat "Write a haiku about caches" && cosine down
  cosine serve verifier --help        one service's own options (also: python -m cosine.verifier)
  cosine bench compare --quick       CoSine against transformers baselines and its own switches, same run (about 6 min)
  cosine plan --validate --quick      the simulator against the local cluster at concurrency 1, 4, 8 (a few minutes)
  cosine bench faults                 drafters or a scheduler killed mid-stream, 48 streams at once: a table
"""

SERVICES = ("router", "scheduler", "fusion", "drafter", "verifier")


def _zoo(args) -> int:
    from cosine.zoo import registry

    if args.action == "path":
        try:
            print(registry.path_of(args.names[0] if args.names else "target"))
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if args.action == "list":
        entries = registry.list_models()
        if args.json:
            print(json.dumps([{"name": e.name, "kind": e.kind, "domain": e.domain, "path": e.path} for e in entries], indent=2))
        else:
            for e in entries:
                print(f"{e.name:14} {e.kind:7} {e.domain:10} {e.path or '(built in)'}")
        return 0
    if args.action == "build":
        return _zoo_build(args)
    if args.action == "eval":
        return _zoo_eval(args)
    if args.action == "head":
        return _zoo_head(args)
    from cosine.zoo.prepare import prepare_all

    for path in prepare_all(force=args.force):
        print(path)
    return 0


def _domains(args) -> tuple[str, ...] | None:
    """`--domains` (default: all), or None after saying which are unknown."""
    from cosine.zoo.corpora import DOMAINS

    domains = tuple(args.domains.split(",")) if args.domains else DOMAINS
    unknown = set(domains) - set(DOMAINS)
    if unknown:
        print(f"unknown domain(s) {sorted(unknown)}; known: {', '.join(DOMAINS)}", file=sys.stderr)
        return None
    return domains


def _zoo_build(args) -> int:
    from cosine.zoo.build import BuildConfig, build, format_table, report_dir
    from cosine.zoo.prepare import prepare_all

    domains = _domains(args)
    if domains is None:
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prepare_all()
    cfg = BuildConfig(minutes=args.minutes, domains=domains, layers=tuple(int(x) for x in args.layers.split(",")),
                      vocab_size=args.vocab_size, seed=args.seed, force=args.force)
    built = build(cfg)
    for path in built:
        print(path)
    if not built:
        print(f"every drafter of {', '.join(domains)} is built (--force rebuilds)")
    if (report_dir() / "eval.json").exists():
        print(format_table(_int_keys(json.loads((report_dir() / "eval.json").read_text()))))
    return 0


def _zoo_head(args) -> int:
    from cosine.zoo.head import HeadConfig, run_head

    domains = _domains(args)
    if domains is None:
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        out, report = run_head(HeadConfig(train_seconds=args.train_seconds, vocab=args.head_vocab, seed=args.seed), domains)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 1
    held = report.get("held_out")
    if held:
        print(f"held-out prompts ({held['positions']} positions): chains match the target's first "
              + ", ".join(f"{k + 1}: {a:.2f}" for k, a in enumerate(held["accepted"]))
              + "; tokens a step commits drafting d = " + ", ".join(f"{d}: {t:.2f}" for d, t in held["tokens_per_step"].items()))
    calibration = report.get("calibration")
    if calibration:
        print(f"calibration (fitted on {calibration['fitted_on']} held-out positions, checked on the other "
              f"{calibration['checked_on']}): temperatures " + ", ".join(f"{t:.2f}" for t in calibration["temperatures"])
              + "; first k tokens written / the head's path probability before -> after: "
              + ", ".join(f"{k + 1}: {a:.2f} / {b:.2f} -> {c:.2f}" for k, (a, b, c) in enumerate(zip(
                  calibration["accepted"], calibration["path_probability_before"], calibration["path_probability_after"]))))
    for load, row in (report.get("held_out_trees") or {}).items():
        print(f"drafting at the verifier's cost floor for {load} ({row['floor']:.2f}, at most {row['nodes']} nodes): "
              f"chain {row['chain']['tokens_per_step']:.2f} tokens a step with {row['chain']['nodes_per_step']:.2f} nodes, "
              f"tree {row['tree']['tokens_per_step']:.2f} with {row['tree']['nodes_per_step']:.2f}")
    print(out)
    return 0


def _int_keys(report: dict) -> dict:
    """eval.json stores depths as strings (JSON keys); the table wants ints."""
    for s in report["drafters"]:
        for row in s["by_domain"].values():
            for key in ("tau", "speedup"):
                row[key] = {int(d): v for d, v in row[key].items()}
    report["verify_ratio"] = {int(d): v for d, v in report["verify_ratio"].items()}
    return report


def _zoo_eval(args) -> int:
    from cosine.zoo.build import format_table, run_eval

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = Path(args.json).parent if args.json and args.json != "-" else None
    report, paths = run_eval(args.names or None, seed=args.seed, out=out)
    if args.json and args.json != "-" and Path(args.json) != paths["json"]:
        Path(args.json).write_text(paths["json"].read_text())
        paths["json"] = Path(args.json)
    print(format_table(report))
    print(f"wrote {paths['json']} and {paths['png']}")
    return 0


def _up(args) -> int:
    from cosine.cluster import Cluster, ClusterSpec, parse_replicas, stop_saved
    from cosine.zoo import registry

    spec = ClusterSpec(router_port=args.port, redis_url=args.redis_url, target=args.target, log_level=args.log_level,
                       redis_maxmemory=args.redis_maxmemory)
    try:
        spec.replicas = parse_replicas(args.replicas, [d.name for d in spec.drafters])
    except ValueError as exc:
        print(f"cosine up: {exc}", file=sys.stderr)
        return 2
    if not args.target and registry.find(registry.TARGET) is None:
        print("preparing the default models first (cosine zoo)...", file=sys.stderr)
        from cosine.zoo.prepare import prepare_all

        prepare_all()
    stop_saved()  # a cluster left from an earlier --detach would hold the ports
    cluster = Cluster(spec)
    started = time.monotonic()

    def ready(proc):
        print(f"  {proc.name:18} SERVING on {proc.address}", file=sys.stderr)

    print("starting the local cluster...", file=sys.stderr)
    try:
        cluster.start(timeout_s=args.timeout, progress=ready)
    except (RuntimeError, TimeoutError) as exc:
        print(f"cosine up failed: {exc}", file=sys.stderr)
        return 1
    print(f"router ready at {cluster.router_address} ({time.monotonic() - started:.0f}s)", file=sys.stderr)
    print(cluster.router_address, flush=True)
    if args.detach:
        print("stop it with: cosine down", file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while cluster.alive():
            time.sleep(0.5)
        print("a service exited; stopping the cluster", file=sys.stderr)
        return_code = 1
    except KeyboardInterrupt:
        return_code = 0
    print("stopping...", file=sys.stderr)
    cluster.stop()
    return return_code


def _down(args) -> int:
    from cosine.cluster import stop_saved

    if not stop_saved():
        print("no cluster started by `cosine up --detach` is recorded", file=sys.stderr)
        return 1
    print("stopped", file=sys.stderr)
    return 0


def _generate(args) -> int:
    from cosine.client import GenerateOptions, generate

    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or [], drafters=args.drafter or [], no_speculation=args.no_speculation,
        max_depth=args.max_depth, chat=args.chat, timeout=args.timeout, api_key=args.api_key,
    )
    try:
        result = generate(args.addr, args.prompt, options, on_text=None if args.json else lambda t: print(t, end="", flush=True))
    except Exception as exc:  # noqa: BLE001 - a CLI reports, it does not trace back
        import grpc

        if isinstance(exc, grpc.RpcError):
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        raise
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n" + summary_line(result), file=sys.stderr)
    return 0


def summary_line(result: dict) -> str:
    """The closing line of `cosine generate`: what speculation did, in the unit it saves (target forward passes)."""
    s = result["stats"]
    n = len(result["token_ids"])
    line = f"[{result['finish_reason']}; {n} tokens in {s.get('target_passes', s['rounds'])} target passes"
    looked = s.get("lookup_drafted_tokens", 0)
    if s["drafted_tokens"] or looked:
        line += f" ({s['tokens_per_target_pass']:.2f} tokens per pass; plain decoding makes 1.00)"
        if s["drafted_tokens"]:
            line += f", {s['accepted_tokens']}/{s['drafted_tokens']} drafted tokens accepted"
        if looked:
            line += f", {s.get('lookup_accepted_tokens', 0)}/{looked} looked-up tokens accepted"
    else:
        line += " (nothing drafted: plain decoding)"
    return line + f", {result['tokens_per_s']:.1f} tokens/s end to end]"


def _serve(args) -> int:
    import importlib

    module = importlib.import_module(f"cosine.{args.service}.__main__")
    module.main(args.args)
    return 0


def _bench(args) -> int:
    import importlib

    module = importlib.import_module(f"cosine.bench.{args.which}")
    return module.main(args.args) or 0


def _plan(args) -> int:
    from cosine.plan.cli import main as plan_main

    return plan_main(args.args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cosine", description="CoSine: lossless speculative decoding with several drafters, as gRPC services.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    zoo = sub.add_parser(
        "zoo", help="prepare, build, evaluate and find models (default: prepare what is missing)",
        description="prepare: the target (and an untrained drafter); build: distil a drafter per domain "
                    "(code, docs, literary, chat) from the target's own continuations, resumable, cached in "
                    "$COSINE_CACHE; head: train the verifier's feature-conditioned drafter on the build's data; "
                    "eval: tau at depths 1-8, top-1 agreement, cost ratio c and predicted speedup "
                    "of every drafter on every domain's held-out prompts (table, JSON, heat-map PNG); "
                    "list / path NAME: what is prepared and where.")
    zoo.add_argument("action", nargs="?", choices=["prepare", "build", "eval", "head", "list", "path"], default="prepare")
    zoo.add_argument("names", nargs="*", default=[], help="for path: the model's name (target, lm-code, ...); "
                     "for eval: drafters to evaluate (default: all)")
    zoo.add_argument("--json", nargs="?", const="-", default=None,
                     help="for list: print JSON; for eval: also write the report to this path")
    zoo.add_argument("--force", action="store_true", help="for prepare/build: rebuild even if present")
    zoo.add_argument("--minutes", type=float, default=20.0, help="for build: wall-clock budget of the whole build")
    zoo.add_argument("--domains", default="", help="for build: comma-separated subset of code,docs,literary,chat")
    zoo.add_argument("--layers", default="0,1", help="for build: target layers the drafters start from")
    zoo.add_argument("--vocab-size", type=int, default=8192, help="for build: rows of each drafter's reduced head")
    zoo.add_argument("--train-seconds", type=float, default=720.0,
                     help="for head: training time of the verifier's feature-conditioned drafter, after its data "
                          "(default 12 minutes: held-out first-token matches 50 %% after 180 s, 54 %% after 360, 56 %% after 720)")
    zoo.add_argument("--head-vocab", type=int, default=4096, help="for head: tokens the feature head may propose")
    zoo.add_argument("--seed", type=int, default=0, help="for build/eval: seed of prompts, splits and training")
    zoo.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    zoo.set_defaults(func=_zoo)

    up = sub.add_parser("up", help="start Redis and every service on loopback")
    up.add_argument("--port", type=int, default=50051, help="router port (default 50051)")
    up.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    up.add_argument("--redis-maxmemory", default="256mb",
                    help="memory limit of the Redis `up` starts (policy noeviction: when full, new requests get RESOURCE_EXHAUSTED)")
    up.add_argument("--target", default="", help="target model directory (default: the zoo's)")
    up.add_argument("--detach", action="store_true", help="return once ready; stop later with `cosine down`")
    up.add_argument("--replicas", default="", metavar="ROLE=N,...",
                    help="several copies of a role, e.g. verifier=2,drafter-suffix=2,scheduler=2 (roles: verifier, fusion, "
                         "scheduler, drafter-NAME); each new request goes to the least-loaded copy and stays there")
    up.add_argument("--timeout", type=float, default=600, help="seconds to wait for every service to be SERVING")
    up.add_argument("--log-level", default="INFO")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop the cluster `cosine up --detach` started")
    down.set_defaults(func=_down)

    gen = sub.add_parser("generate", help="stream a generation from the router")
    gen.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    gen.add_argument("--addr", default="127.0.0.1:50051", help="router address (default 127.0.0.1:50051)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (server default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--drafter", action="append", help="drafter to use (repeatable; default: the router chooses)")
    gen.add_argument("--no-speculation", action="store_true", help="plain decoding through the verifier")
    gen.add_argument("--max-depth", type=int, default=None, help="draft depth per round")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming text")
    gen.add_argument("--timeout", type=float, default=600, help="deadline of the call in seconds")
    gen.add_argument("--api-key", default=os.environ.get("COSINE_API_KEY", ""),
                     help="the router's API key, if it requires one (default: $COSINE_API_KEY; the chart's router does)")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks: compare (CoSine against its baselines; serving is an alias), engine, faults",
                           description="compare (default): CoSine with each mechanism switched off in turn against transformers "
                                       "generate(), assisted and prompt-lookup generation, side by side (table, --json, PNG plots; "
                                       "--quick: about 5 minutes); serving: the same; engine: native engine vs transformers forwards; "
                                       "faults: fault scenarios (drafters and schedulers SIGKILLed, a scheduler SIGTERMed, overload) against a local cluster it starts")
    bench.add_argument("which", nargs="?", choices=["compare", "serving", "engine", "faults"], default="compare")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (see --help)")
    bench.set_defaults(func=_bench)

    plan = sub.add_parser("plan", help="capacity planning: simulate a deployment with the scheduler's own code (--validate, --sweep)",
                          description="a discrete-event simulation of routers, schedulers, fusion, drafter nodes and verifiers "
                                      "that runs the scheduler service's own policy code on a simulated clock; see "
                                      "`cosine plan --help` for its options")
    plan.add_argument("args", nargs=argparse.REMAINDER, help="the planner's own options (see `cosine plan --help`)")
    plan.set_defaults(func=_plan)

    serve = sub.add_parser("serve", help="run one service in the foreground (as containers do)")
    serve.add_argument("service", choices=SERVICES)
    serve.add_argument("args", nargs=argparse.REMAINDER, help="the service's own options (see --help)")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # every option is the planner's own, --help included
        from cosine.plan.cli import main as plan_main

        return plan_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
