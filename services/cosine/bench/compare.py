"""`cosine bench compare` (also `cosine bench serving`): CoSine against its baselines, side by side in one run.

Same machine, same run, same prompts, same target weights, greedy. Systems (exact names):

  target-only       transformers generate(); batch 1 at concurrency 1, static batches of C at concurrency C
  target-only-bf16  the same with the weights in bf16 (the fair baseline for --dtype bfloat16; not by default)
  llama-cpp         llama.cpp's server on the same weights as GGUF in the same precision (optional: runs
                    where a llama-server binary is given with --llama-server or COSINE_LLAMA_SERVER;
                    skipped with a note otherwise; see cosine/bench/llamacpp.py)
  hf-assisted       transformers assisted generation with the best single LM drafter (batch 1 only)
  hf-prompt-lookup  transformers prompt-lookup decoding, prompt_lookup_num_tokens (batch 1 only)
  cosine-plain      the cluster with speculation disabled: the native engine alone (for reference)
  vanilla-sd        the cluster, one drafter (the same as hf-assisted), fixed depth, synchronous
                    (fusion=single, routing off, adaptive depth off, pipelining off)
  no-routing        full system but routing off: the router's first default drafter, always
  no-fusion         full system but fusion=single: one drafter per round (the one routing picks)
  merge-fusion      full system but fusion=merge: drafters draft independently, chains prefix-merged
  no-pipeline       full system but pipelining off (no drafting ahead during verification)
  fixed-depth       full system but adaptive depth off (--depth tokens every round)
  cosine-full       every mechanism on: routing, confidence fusion, adaptive depth, pipelining

Workload: the drafter zoo's held-out prompts of four domains (code, docs, literary, chat;
see cosine/bench/workload.py for their sources), interleaved, --per-domain of each. Load:
closed loop at each --concurrency (C clients, each sends its next request when its last one
finished) and, with --rate, a Poisson arrival process (seeded). transformers' assisted and
prompt-lookup generation take batch 1 only: they run at concurrency 1 and at Poisson rates
(FIFO, one request at a time).

Cores: systems run one after another, never at the same time. The transformers baselines run
in this process with --threads torch threads, before the cluster starts. The cluster's
processes (router, scheduler, fusion, one per drafter, verifier, Redis) share the same cores
through the OS scheduler: the verifier runs 2 torch threads, each LM drafter 1.

Figures per system and load point: output tokens/s (all output tokens over the wall time of
the run), TTFT and TPOT p50/p99 (TPOT = (last token - first token) / (n - 1) per request),
end-to-end latency, mean accepted length (output tokens per verification step of a request, i.e.
accepted draft tokens + the target's own; a decode run's plain steps count one each), acceptance rate (accepted / drafted), verifier and drafter
busy fractions (rate of cosine_worker_busy_seconds_total over the run; drafters summed), how
many outputs are identical to target-only's batch-1 greedy output, and ratios to target-only
and vanilla-sd at the same load point. Accepted length per domain per drafter comes from a
sweep: each drafter alone, fixed depth, every prompt (--sweep-tokens new tokens).

Output: a table on the terminal (progress bar while it runs); --json PATH writes the report
(a top-level `systems` list) and, next to it, PATH-stem_load.png (throughput and latency
against concurrency) and PATH-stem_accepted.png (accepted length per domain per drafter).

Default (the full run): 2 prompts per domain, 64 new tokens, concurrency 1, 4, 8, 16 and
Poisson 0.5 requests/s for every system, a 48-token sweep: about 30 minutes on 2 cores.
--quick: 1 prompt per domain, 48 new tokens, concurrency 1 for every system and 4 for
target-only / cosine-plain / vanilla-sd / cosine-full, a 16-token sweep: about 5 minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from cosine.bench import stats as S

HF_SYSTEMS = ("target-only", "target-only-bf16", "hf-assisted", "hf-prompt-lookup")
CLUSTER_SYSTEMS = ("cosine-plain", "vanilla-sd", "no-routing", "no-fusion", "merge-fusion", "no-pipeline", "fixed-depth",
                   "cosine-full")
PEER_SYSTEMS = ("llama-cpp",)
ALL_SYSTEMS = HF_SYSTEMS + PEER_SYSTEMS + CLUSTER_SYSTEMS
BATCH1 = ("hf-assisted", "hf-prompt-lookup")
DEFAULT_SYSTEMS = tuple(s for s in ALL_SYSTEMS if s != "target-only-bf16")  # bf16 baseline: by name


# the scheduler's per-round histograms (sums and counts), for where a round's time goes
ROUND_METRICS = {
    "rounds": "cosine_scheduler_rounds_total",
    "draft_sum": "cosine_scheduler_draft_seconds_sum", "draft_count": "cosine_scheduler_draft_seconds_count",
    "draft_compute_sum": "cosine_scheduler_draft_compute_seconds_sum",
    "verify_sum": "cosine_scheduler_verify_seconds_sum", "verify_compute_sum": "cosine_scheduler_verify_compute_seconds_sum",
    "commit_sum": "cosine_scheduler_commit_seconds_sum",
}


def round_breakdown(before: dict, after: dict) -> dict | None:
    """Mean ms per round between two scrapes: drafting (rounds that drafted, as fusion measured it), verification
    (as the verifier measured it), the Redis commit, and the gRPC/queueing time around both calls."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ROUND_METRICS}
    rounds = d["rounds"]
    if rounds <= 0:
        return None
    return {"rounds": int(rounds), "drafting_rounds": int(d["draft_count"]),
            "draft_ms": d["draft_compute_sum"] / d["draft_count"] * 1000 if d["draft_count"] else 0.0,
            "verify_ms": d["verify_compute_sum"] / rounds * 1000,
            "commit_ms": d["commit_sum"] / rounds * 1000,
            "overhead_ms": ((d["draft_sum"] - d["draft_compute_sum"]) + (d["verify_sum"] - d["verify_compute_sum"])) / rounds * 1000}


def cluster_snapshot(verifier_port: int | None, drafter_ports: list[int | None], scheduler_port: int | None) -> dict:
    """The counters the cluster rows are computed from (their differences between two snapshots)."""
    from cosine.bench import client

    vs = client.scrape(verifier_port)
    v = client.metric_sum(vs, "cosine_worker_busy_seconds_total")
    d = sum(client.metric_sum(client.scrape(port), "cosine_worker_busy_seconds_total") for port in drafter_ports)
    s = client.scrape(scheduler_port)
    return {"verifier": v, "drafters": d,
            "batch_sum": vs.get("cosine_verifier_batch_size_sum", 0.0),
            "batch_count": vs.get("cosine_verifier_batch_size_count", 0.0),
            "model_step_sum": vs.get("cosine_verifier_step_seconds_sum", 0.0),
            "step_sum": s.get("cosine_scheduler_step_seconds_sum", 0.0),
            "step_count": s.get("cosine_scheduler_step_seconds_count", 0.0),
            "ahead_used": s.get('cosine_scheduler_draft_ahead_total{outcome="used"}', 0.0),
            "ahead_discarded": s.get('cosine_scheduler_draft_ahead_total{outcome="discarded"}', 0.0),
            # the verifier's own drafts, the lookup's and the feature head's (label source)
            "lookup_drafted": client.metric_sum(vs, "cosine_verifier_lookup_tokens_total", outcome="drafted"),
            "lookup_accepted": client.metric_sum(vs, "cosine_verifier_lookup_tokens_total", outcome="accepted"),
            "head_drafted": client.metric_sum(vs, "cosine_verifier_lookup_tokens_total", outcome="drafted", source="head"),
            "head_accepted": client.metric_sum(vs, "cosine_verifier_lookup_tokens_total", outcome="accepted", source="head"),
            **{k: s.get(m, 0.0) for k, m in ROUND_METRICS.items()}}


def step_breakdown(before: dict, after: dict, wall_s: float) -> dict | None:
    """Where a verification step's time goes between two snapshots (ms per step): the step as the scheduler saw it
    (send to answer), of which the verifier's model thread (its busy time per batch, prefills of new requests
    included) and the rest (gRPC, event loops, the verifier's queue); and the time between steps (the scheduler's
    commit, streaming and choice, and waiting for drafts). Steps: the verifier's batches; its mean batch size too."""
    batches = after["batch_count"] - before["batch_count"]
    steps = after["step_count"] - before["step_count"]
    if batches <= 0 or steps <= 0:
        return None
    step_ms = (after["step_sum"] - before["step_sum"]) / steps * 1000
    model_ms = (after["verifier"] - before["verifier"]) / batches * 1000
    out = {"steps": int(steps), "verifier_batches": int(batches),
           "mean_batch": (after["batch_sum"] - before["batch_sum"]) / batches,
           "wall_per_step_ms": wall_s / steps * 1000, "step_ms": step_ms, "verifier_model_ms": model_ms,
           "grpc_queue_ms": step_ms - model_ms, "between_steps_ms": wall_s / steps * 1000 - step_ms}
    if "model_step_sum" in after:  # the verification steps alone (prefills of new requests not included)
        out["verifier_step_ms"] = (after["model_step_sum"] - before.get("model_step_sum", 0.0)) / batches * 1000
    return out


def cluster_speculation(best_lm: str, depth: int) -> dict[str, dict]:
    """SpeculationParams (as dicts for the GenerateRequest) of each cluster system."""
    from cosine.common.v1 import common_pb2 as c

    full = {"fusion": c.FUSION_MODE_CONFIDENCE, "routing": True, "adaptive_depth": True, "pipelining": True}
    return {
        "cosine-plain": {"disabled": True},
        "vanilla-sd": {"drafters": [best_lm], "max_depth": depth, "fusion": c.FUSION_MODE_SINGLE, "routing": False,
                       "adaptive_depth": False, "pipelining": False},
        "no-routing": {**full, "routing": False},
        "no-fusion": {**full, "fusion": c.FUSION_MODE_SINGLE},
        "merge-fusion": {**full, "fusion": c.FUSION_MODE_MERGE},
        "no-pipeline": {**full, "pipelining": False},
        "fixed-depth": {**full, "adaptive_depth": False, "max_depth": depth},
        "cosine-full": dict(full),
    }


def sweep_speculation(drafter: str, depth: int) -> dict:
    from cosine.common.v1 import common_pb2 as c

    return {"drafters": [drafter], "max_depth": depth, "fusion": c.FUSION_MODE_SINGLE, "routing": False,
            "adaptive_depth": False, "pipelining": False}


def best_lm_drafter(names: list[str], domains: list[str]) -> tuple[str, dict]:
    """The LM drafter with the highest mean tau (depth 4, from `cosine zoo build`/`eval`, in the model card)
    over the workload's domains; the first LM drafter when no card has tau."""
    from cosine.zoo.registry import CARD, find

    scores = {}
    for name in names:
        entry = find(name)
        if entry is None or not entry.path:
            continue
        try:
            tau = json.loads((Path(entry.path) / CARD).read_text()).get("tau_depth4_by_domain") or {}
        except (OSError, ValueError):
            tau = {}
        values = [tau[d] for d in domains if d in tau]
        if values:
            scores[name] = sum(values) / len(values)
    if scores:
        return max(scores, key=scores.get), scores
    return names[0], {}


def parse_list(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()] if text else []


def build_args(argv):
    p = argparse.ArgumentParser(prog="cosine bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run, about 5 minutes (see above)")
    p.add_argument("--per-domain", type=int, default=None, help="prompts per domain (default 2; quick 1)")
    p.add_argument("--workload", default="zoo", choices=["zoo", "unlike"],
                   help="zoo: the zoo's held-out prompts (templates it never trains on, same generator); unlike: 16 "
                        "hand-written prompts of code, prose, technical, chat and arithmetic requests unlike anything "
                        "the zoo trains on (--per-domain does not apply)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 64; quick 48)")
    p.add_argument("--concurrency", default=None, help="closed-loop concurrencies, comma-separated (default 1,4,8,16; quick 1,4)")
    p.add_argument("--rate", default=None, help="Poisson arrival rates in requests/s, comma-separated (default 0.5; quick none; '': none)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per load point (default: the workload, at least 2 per client; Poisson: the workload)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="systems to run (target-only always runs: it is the reference)")
    p.add_argument("--load-systems", default=None,
                   help="systems run at concurrency > 1 and Poisson rates (default: all; quick: target-only,cosine-plain,vanilla-sd,cosine-full)")
    p.add_argument("--drafter", default=None, help="the single LM drafter of hf-assisted and vanilla-sd (default: the best by tau)")
    p.add_argument("--depth", type=int, default=4, help="draft depth of vanilla-sd, fixed-depth and the sweep")
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf-prompt-lookup")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the transformers baselines")
    p.add_argument("--sweep-tokens", type=int, default=None, help="new tokens per prompt of the per-drafter sweep (default 48; quick 16; 0: no sweep)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (use the zoo build's seed) and of the arrivals")
    p.add_argument("--json", dest="json_path", default=None, help="write the report here, and the PNG plots next to it")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="weights of the cluster's verifier and LM drafters and of llama-cpp's GGUF (auto: the services' "
                        "default, fp32 on CPU); identical_outputs compare with target-only's fp32 output, so they only "
                        "hold in float32")
    p.add_argument("--verifier-threads", type=int, default=2,
                   help="torch threads of the cluster's verifier (default 2: every core of this machine)")
    p.add_argument("--suffix-memory-tokens", type=int, default=0,
                   help="the suffix drafter's memory of earlier outputs, in tokens (default 0: off). The workload sends "
                        "the same prompts at every load point and to every system, so with memory on the suffix "
                        "drafter answers repeats from what the target wrote before: figures no stream of distinct "
                        "requests gets. Set it (e.g. 131072, the service default) to measure that case on purpose")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server binary for the llama-cpp system (else $COSINE_LLAMA_SERVER, else PATH)")
    p.add_argument("--llama-gguf", default=None,
                   help="the target as GGUF in the run's precision (else $COSINE_LLAMA_GGUF, else converted once)")
    args = p.parse_args(argv)
    q = args.quick
    args.per_domain = args.per_domain or (1 if q else 2)
    args.max_new_tokens = args.max_new_tokens or (48 if q else 64)
    args.concurrency = parse_list(args.concurrency if args.concurrency is not None else ("1,4" if q else "1,4,8,16"))
    args.rate = parse_list(args.rate if args.rate is not None else ("" if q else "0.5"), float)
    args.sweep_tokens = args.sweep_tokens if args.sweep_tokens is not None else (16 if q else 48)
    args.systems = [s for s in parse_list(args.systems, str) if s]
    unknown = sorted(set(args.systems) - set(ALL_SYSTEMS))
    if unknown:
        p.error(f"unknown system(s) {unknown}; known: {', '.join(ALL_SYSTEMS)}")
    if "target-only" not in args.systems:
        args.systems.insert(0, "target-only")
    load = args.load_systems if args.load_systems is not None else ("target-only,target-only-bf16,llama-cpp,cosine-plain,vanilla-sd,cosine-full" if q else ",".join(ALL_SYSTEMS))
    args.load_systems = parse_list(load, str)
    if not args.concurrency and not args.rate:
        p.error("give at least one --concurrency or --rate")
    return args


def load_points(args) -> list[tuple[str, int | None, float | None]]:
    """(mode, concurrency, rate) of every load point, concurrency 1 first."""
    pts = [("closed", c, None) for c in sorted(set(args.concurrency) | {1})]  # target-only at c=1 is the reference
    pts += [("poisson", None, r) for r in args.rate]
    return pts


def runs_at(system: str, point, args) -> bool:
    mode, conc, _ = point
    if system not in args.systems:
        return False
    if mode == "closed" and conc == 1 and 1 not in args.concurrency:
        return system == "target-only"  # only the reference outputs
    if system in BATCH1 and mode == "closed" and conc != 1:
        return False
    if mode == "closed" and conc == 1:
        return True
    return system in args.load_systems


def n_requests(point, n_prompts: int, args) -> int:
    mode, conc, _ = point
    if args.requests:
        return args.requests
    return max(n_prompts, 2 * conc) if mode == "closed" else n_prompts


def main(argv: list[str] | None = None) -> int:
    args = build_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster is stopped on a kill too
    started = time.time()
    from tqdm.auto import tqdm

    from cosine.bench.workload import build_workload
    from cosine.cluster import zoo_drafters
    from cosine.zoo.registry import TARGET, cache_root, path_of

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workload = build_workload(args.per_domain, args.seed, cache_root(), source=args.workload)
    domains = sorted({p.domain for p in workload})
    drafter_specs = zoo_drafters()
    lm_names = [d.name for d in drafter_specs if d.kind == "lm"]
    best, taus = (args.drafter, {}) if args.drafter else best_lm_drafter(lm_names, domains)
    points = load_points(args)
    notes: list[str] = []
    llama_server = None
    if "llama-cpp" in args.systems:
        from cosine.bench import llamacpp

        llama_server = llamacpp.find_server(args.llama_server)
        if llama_server is None:
            args.systems.remove("llama-cpp")
            notes.append(f"llama-cpp: skipped, no llama-server binary found; {llamacpp.BUILD_HINT}")
    plan = [(s, pt) for pt in points for s in ALL_SYSTEMS if runs_at(s, pt, args)]
    sweep = [d.name for d in drafter_specs] if args.sweep_tokens > 0 else []
    total = sum(n_requests(pt, len(workload), args) for _, pt in plan) + len(sweep) * len(workload)
    bar = tqdm(total=total, desc="cosine bench", unit="req", mininterval=2.0)
    rows: list[dict] = []
    references: dict[int, list[int]] = {}
    target_dir = path_of(TARGET)

    def order_and_arrivals(pt):
        n = n_requests(pt, len(workload), args)
        order = S.request_order(len(workload), n)
        arrivals = S.poisson_arrivals(n, pt[2], args.seed) if pt[0] == "poisson" else None
        return order, arrivals

    # --- the transformers baselines, in this process, cluster not started ---------------------
    import torch

    from cosine.bench import hf

    torch.set_num_threads(args.threads)
    bar.set_postfix_str("loading the target")
    tok, model = hf.load_target(target_dir)
    systems: dict[str, hf.HFSystem] = {"target-only": hf.HFSystem("target-only", model, tok, max_batch=64)}
    if "target-only-bf16" in args.systems:
        from cosine.engine.models import load_causal_lm

        systems["target-only-bf16"] = hf.HFSystem("target-only-bf16", load_causal_lm(target_dir, dtype="bfloat16"), tok,
                                                  max_batch=64)
        notes.append("target-only-bf16: target-only with the target's weights in bf16 (transformers; on a CPU with AMX "
                     "faster than fp32 at batch 8, slower at batch 1): its outputs are compared with fp32 target-only's")
    if "hf-assisted" in args.systems:
        assistant, note = hf.full_vocab_assistant(path_of(best), target_dir)
        notes.append(f"hf-assisted: assistant {best}; {note}; transformers' default assisted schedule "
                     f"(num_assistant_tokens 20, confidence threshold 0.4)")
        systems["hf-assisted"] = hf.HFSystem("hf-assisted", model, tok, max_batch=1, assistant_model=assistant)
    if "hf-prompt-lookup" in args.systems:
        systems["hf-prompt-lookup"] = hf.HFSystem("hf-prompt-lookup", model, tok, max_batch=1,
                                                  prompt_lookup_num_tokens=args.lookup_tokens)
    warm_ids = workload[0].token_ids(tok)
    for pt in points:
        for name, system in systems.items():
            if not runs_at(name, pt, args):
                continue
            bar.set_postfix_str(f"{name} {_point_label(pt)}")
            system.warm_up(warm_ids)
            order, arrivals = order_and_arrivals(pt)
            if pt[0] == "closed":
                records, wall = system.closed_loop(workload, order, pt[1], args.max_new_tokens, bar)
            else:
                records, wall = system.poisson(workload, order, arrivals, args.max_new_tokens, bar)
            if name == "target-only" and pt == ("closed", 1, None):
                references = {r.prompt_index: r.token_ids for r in records}
            rows.append(S.summarise(name, records, references, mode=pt[0], concurrency=pt[1], rate=pt[2], wall_s=wall)
                        | {"per_request": _per_request(records)})
    del systems, model
    gc.collect()
    if llama_server is not None:
        rows += run_llama_cpp(args, llama_server, workload, tok, target_dir, points, references, order_and_arrivals,
                              bar, notes)
    notes.append("hf-assisted and hf-prompt-lookup: transformers' assisted generation takes batch 1 only, so they run at "
                 "concurrency 1 (and at Poisson rates, one request at a time)")

    # --- the cluster ---------------------------------------------------------------------------
    from cosine.bench import client
    from cosine.cluster import Cluster, ClusterSpec, free_port

    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-bench-run-")  # logs; leaves a `cosine up` state alone
    # KV slots for every client plus the ones still being freed when a closed-loop client sends its next request
    # (at exactly 16 clients and the default 16 slots, the verifier refuses some requests: RESOURCE_EXHAUSTED)
    slots = str(max(16, max(args.concurrency or [1]) + 8, len(workload) + 8 if args.rate else 0))
    os.environ["COSINE_VERIFIER_MAX_SLOTS"] = os.environ["COSINE_DRAFTER_MAX_REQUESTS"] = slots
    os.environ["COSINE_ROUTER_MAX_STREAMS"] = slots  # the router admits what the verifier holds
    os.environ.setdefault("COSINE_VERIFIER_MAX_CONTEXT", "2048")  # bounds the preallocated KV memory of those slots
    os.environ["COSINE_VERIFIER_DTYPE"] = os.environ["COSINE_DRAFTER_DTYPE"] = args.dtype
    os.environ["COSINE_DRAFTER_MEMORY_TOKENS"] = str(args.suffix_memory_tokens)
    notes.append(f"suffix drafter memory of earlier outputs: {args.suffix_memory_tokens} tokens" +
                 (" (off: the workload repeats its prompts, and memory would replay the target's earlier answers)"
                  if not args.suffix_memory_tokens else
                  " (on: repeated prompts are drafted from the target's earlier answers to them)"))
    notes.append(f"precision: the cluster's verifier and LM drafters --dtype {args.dtype} "
                 f"({_native_dtype(args.dtype)} here); target-only and the transformers baselines fp32")
    spec = ClusterSpec(router_port=free_port(), drafters=drafter_specs, verifier_threads=max(1, args.verifier_threads))
    notes.append(f"cores: systems ran one after another on {os.cpu_count()} CPUs; transformers baselines in the bench process "
                 f"with {args.threads} torch threads before the cluster started; the cluster's processes share the same "
                 f"CPUs through the OS scheduler (verifier {spec.verifier_threads} torch threads, each LM drafter "
                 f"{spec.drafter_threads}; router, scheduler, fusion, the suffix and ngram drafters and Redis are asyncio/IO processes); verifier "
                 f"KV slots and drafter request slots: {slots}, verifier max context "
                 f"{os.environ['COSINE_VERIFIER_MAX_CONTEXT']}; every other setting is the services' default" +
                 "".join(f", but {k}={v} from the environment" for k, v in sorted(os.environ.items())
                         if k.startswith(("COSINE_SCHEDULER_", "COSINE_ROUTER_", "COSINE_FUSION_")) and k != "COSINE_ROUTER_MAX_STREAMS"))
    speculation = cluster_speculation(best, args.depth)
    cluster = Cluster(spec)
    bar.set_postfix_str("starting the cluster")
    cluster_rows: list[dict] = []
    by_drafter: dict[str, dict[str, float]] = {}
    try:
        cluster.start()
        procs = {p.name: p for p in cluster.processes}
        verifier_port = procs["verifier"].metrics_port
        drafter_ports = [p.metrics_port for n, p in procs.items() if n.startswith("drafter-")]
        scheduler_port = procs["scheduler"].metrics_port

        def snapshot():
            return cluster_snapshot(verifier_port, drafter_ports, scheduler_port)

        # warm-up: every drafter drafts once, plain decoding once
        from cosine.common.v1 import common_pb2 as c

        bar.set_postfix_str("cluster warm-up")
        warm = [{"disabled": True}, {"drafters": [d.name for d in drafter_specs], "fusion": c.FUSION_MODE_MERGE, "max_depth": 2}]
        for w in warm:
            client.closed_loop(cluster.router_address, workload, [0], w, 1, 8)
        plain_refs: dict[int, list[int]] | None = None
        for pt in points:
            for name in CLUSTER_SYSTEMS:
                if not runs_at(name, pt, args):
                    continue
                bar.set_postfix_str(f"{name} {_point_label(pt)}")
                order, arrivals = order_and_arrivals(pt)
                before = snapshot()
                if pt[0] == "closed":
                    records, wall = client.closed_loop(cluster.router_address, workload, order, speculation[name], pt[1],
                                                       args.max_new_tokens, bar)
                else:
                    records, wall = client.poisson(cluster.router_address, workload, order, arrivals, speculation[name],
                                                   args.max_new_tokens, bar)
                after = snapshot()
                row = S.summarise(name, records, references, mode=pt[0], concurrency=pt[1], rate=pt[2], wall_s=wall,
                                  verifier_busy_s=after["verifier"] - before["verifier"],
                                  drafter_busy_s=after["drafters"] - before["drafters"])
                row["draft_ahead_used"] = int(after["ahead_used"] - before["ahead_used"])
                row["draft_ahead_discarded"] = int(after["ahead_discarded"] - before["ahead_discarded"])
                row["lookup_drafted"] = int(after["lookup_drafted"] - before["lookup_drafted"])
                row["lookup_accepted"] = int(after["lookup_accepted"] - before["lookup_accepted"])
                row["head_drafted"] = int(after["head_drafted"] - before["head_drafted"])
                row["head_accepted"] = int(after["head_accepted"] - before["head_accepted"])
                row["round_ms"] = round_breakdown(before, after)
                row["step_ms"] = step_breakdown(before, after, wall)
                row["verifier_mean_batch"] = row["step_ms"]["mean_batch"] if row["step_ms"] else None
                row["speculation"] = {k: v for k, v in speculation[name].items()}
                row["per_request"] = _per_request(records)
                # against the cluster's own plain decoding (same engine, same precision): with --dtype bfloat16 the
                # check that speculation changed no token, where target-only's fp32 output is another model's
                if name == "cosine-plain" and pt == ("closed", 1, None):
                    plain_refs = {r.prompt_index: r.token_ids for r in records if r.error is None}
                if plain_refs is not None:
                    row["identical_to_cosine_plain"] = sum(plain_refs.get(r.prompt_index) == r.token_ids
                                                           for r in records if r.error is None)
                errors = [r.error for r in records if r.error]
                if errors:
                    notes.append(f"{name} {_point_label(pt)}: {len(errors)} request(s) failed, first: {errors[0]}")
                cluster_rows.append(row)
        for name in sweep:
            bar.set_postfix_str(f"sweep {name}")
            records, _ = client.closed_loop(cluster.router_address, workload, list(range(len(workload))),
                                            sweep_speculation(name, args.depth), 1, args.sweep_tokens, bar)
            by_drafter[name] = S.accepted_len_by_domain([r for r in records if r.error is None])
    finally:
        cluster.stop()
        bar.close()
    rows += cluster_rows
    same = [f"{r['name']} {_point_label((r['mode'], r['concurrency'], r['rate']))} {r['identical_to_cosine_plain']}/{r['prompts']}"
            for r in cluster_rows if r.get("identical_to_cosine_plain") is not None and r["name"] != "cosine-plain"]
    if same:
        notes.append("outputs identical to cosine-plain's at concurrency 1 (the same engine and precision, speculation "
                     "off): " + ", ".join(same))
    S.add_ratios(rows)
    notes += pipeline_notes(rows) + routing_notes(rows) + lookup_notes(rows)

    meta = {
        "command": "cosine bench compare " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": machine(),
        "target": str(target_dir),
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "seed": args.seed,
        "best_single_drafter": best,
        "drafter_tau_depth4": taus,
        "drafters": [d.name for d in drafter_specs],
        "depth": args.depth,
        "workload": [{"index": i, "domain": p.domain, "chat": p.chat, "source": p.source, "text": p.text[:200]}
                     for i, p in enumerate(workload)],
        "accepted_len_by_drafter": by_drafter,
        "sweep_tokens": args.sweep_tokens,
        "notes": notes,
    }
    doc = S.report(rows, meta)
    print()
    print(format_table(doc))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        from cosine.bench import plots

        written = [plots.plot_load(doc["systems"], path.with_name(path.stem + "_load.png")),
                   plots.plot_accepted(by_drafter, path.with_name(path.stem + "_accepted.png"))]
        doc["plots"] = [str(w) for w in written if w]
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nreport: {path}" + "".join(f"\nplot:   {w}" for w in doc["plots"]))
    return 0


def _native_dtype(name: str) -> str:
    """The dtype the native engine runs for a --dtype setting on this machine's CPU, by name."""
    from cosine.engine.models import resolve_dtype

    return str(resolve_dtype(name, "cpu")).replace("torch.", "")


def run_llama_cpp(args, server, workload, tok, target_dir, points, references, order_and_arrivals, bar, notes) -> list[dict]:
    """The llama-cpp system at every load point it runs at: its own server process, started and stopped here."""
    from cosine.bench import llamacpp
    from cosine.zoo.registry import cache_root

    outtype = llamacpp.gguf_outtype(_native_dtype(args.dtype))
    rows: list[dict] = []
    try:
        bar.set_postfix_str(f"llama-cpp: GGUF {outtype}")
        gguf = llamacpp.ensure_gguf(server, target_dir, outtype, cache_root() / "gguf", args.llama_gguf)
    except (OSError, RuntimeError) as exc:
        notes.append(f"llama-cpp: skipped, {exc}")
        return rows
    parallel = max([c for _, c, _ in points if c] + [1])
    if args.rate:
        parallel = max(parallel, len(workload))
    ids = {i: p.token_ids(tok) for i, p in enumerate(workload)}
    context = max(len(v) for v in ids.values()) + args.max_new_tokens + 16
    log = Path(os.environ.get("COSINE_RUN_DIR") or tempfile.mkdtemp(prefix="cosine-bench-llama-")) / "llama-server.log"
    notes.append(f"llama-cpp: {server} on {gguf.name} ({outtype}), {args.threads} threads, {parallel} slots; log {log}")
    srv = llamacpp.LlamaServer(server, gguf, args.threads, parallel, context, log)
    try:
        bar.set_postfix_str("llama-cpp: starting")
        srv.start()
        system = llamacpp.LlamaCppSystem(srv.url, ids)
        system.warm_up(0)
        for pt in points:
            if not runs_at("llama-cpp", pt, args):
                continue
            bar.set_postfix_str(f"llama-cpp {_point_label(pt)}")
            order, arrivals = order_and_arrivals(pt)
            if pt[0] == "closed":
                records, wall = system.closed_loop(workload, order, pt[1], args.max_new_tokens, bar)
            else:
                records, wall = system.poisson(workload, order, arrivals, args.max_new_tokens, bar)
            errors = [r.error for r in records if r.error]
            if errors:
                notes.append(f"llama-cpp {_point_label(pt)}: {len(errors)} request(s) failed, first: {errors[0]}")
            rows.append(S.summarise("llama-cpp", records, references, mode=pt[0], concurrency=pt[1], rate=pt[2],
                                    wall_s=wall) | {"per_request": _per_request(records)})
    except (OSError, RuntimeError, TimeoutError) as exc:
        notes.append(f"llama-cpp: stopped, {exc} (see {log})")
    finally:
        srv.stop()
    return rows


def _point_label(pt) -> str:
    return f"c={pt[1]}" if pt[0] == "closed" else f"poisson {pt[2]}/s"


def _per_request(records) -> list[dict]:
    return [{"prompt": r.prompt_index, "domain": r.domain, "tokens": len(r.token_ids),
             "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
             "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1000, 2),
             "e2e_ms": None if r.e2e_s is None else round(r.e2e_s * 1000, 1),
             "rounds": r.rounds, "drafted": r.drafted, "accepted": r.accepted, "drafters": r.drafters, "error": r.error}
            for r in sorted(records, key=lambda r: r.arrival_s)]


def pipeline_notes(rows: list[dict]) -> list[str]:
    """Whether pipelining did anything, measured: rounds drafted ahead and used, per load point."""
    out = []
    for row in rows:
        if row["name"] in ("cosine-full", "no-pipeline"):
            out.append(f"{row['name']} {_point_label((row['mode'], row['concurrency'], row['rate']))}: "
                       f"{row.get('draft_ahead_used', 0)} rounds drafted ahead and used, "
                       f"{row.get('draft_ahead_discarded', 0)} discarded")
    if out:
        out.append("the pipelining switch (drafting a request's next round ahead during its verification) only acts while "
                   "the scheduler has one request in flight: at concurrency > 1 no-pipeline is the full system (the step "
                   "loop's overlap of one group's drafting with another group's verification runs in every system)")
    return out


def lookup_notes(rows: list[dict]) -> list[str]:
    """How much of each cluster system's drafting was the verifier's own lookup (counted in its acc/rnd and accept)."""
    out = [f"{row['name']} {_point_label((row['mode'], row['concurrency'], row['rate']))}: the verifier's lookup verified "
           f"{row['lookup_drafted']} tokens with plain steps, {row['lookup_accepted']} accepted; of them the feature "
           f"head's {row.get('head_drafted', 0)}, {row.get('head_accepted', 0)} accepted"
           for row in rows if row.get("lookup_drafted")]
    if out:
        out.insert(0, "lookup (COSINE_SCHEDULER_LOOKUP_TOKENS; requests that speculate): the verifier looks each request's own "
                      "tokens up before its plain steps, or drafts with its feature head (COSINE_VERIFIER_FEATURE_HEAD), "
                      "and verifies what it finds with the step")
    return out


def routing_notes(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        if row["name"] in ("no-routing", "vanilla-sd", "no-fusion", "cosine-full") and row["mode"] == "closed" and row["concurrency"] == 1:
            out.append(f"{row['name']} c=1 drafted with: {', '.join(row.get('drafters_used') or []) or 'none'}")
    return out


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = Path("/proc/cpuinfo").read_text()
        isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    except OSError:
        isa = []
    import torch

    return f"{os.cpu_count()} CPUs ({cpu}; {', '.join(isa) or 'no bf16 ISA'}), torch {torch.__version__}, fp32"


def _f(x, fmt, width):
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def format_table(doc: dict) -> str:
    header = (f"{'system':17} {'load':>9} {'tok/s':>7} {'xtarget':>7} {'xvanil':>6} {'TTFT50':>7} {'TTFT99':>7} "
              f"{'TPOT50':>7} {'TPOT99':>7} {'e2e50':>7} {'acc/rnd':>7} {'accept':>6} {'verif':>5} {'draft':>5} {'ident':>6}")
    lines = [f"{len(doc['workload'])} prompts ({', '.join(sorted({w['domain'] for w in doc['workload']}))}), "
             f"{doc['max_new_tokens']} new tokens, greedy; times in ms; busy = fraction of wall time; "
             f"ratios against the same load point of this run", header, "-" * len(header)]
    last = None
    for row in doc["systems"]:
        point = (row["mode"], row["concurrency"], row["rate"])
        if last is not None and point != last:
            lines.append("")
        last = point
        ident = f"{row['identical_outputs']}/{row['prompts']}" if row["identical_outputs"] is not None else "-"
        if row.get("errors"):
            ident += f" ({row['errors']} failed)"
        lines.append(
            f"{row['name']:17} {_point_label(point):>9} {_f(row['tokens_per_s'], '.1f', 7)} "
            f"{_f(row['ratio_to_target_only'], '.2f', 6)}x {_f(row['ratio_to_vanilla_sd'], '.2f', 5)}x "
            f"{_f(row['ttft_ms_p50'], '.0f', 7)} {_f(row['ttft_ms_p99'], '.0f', 7)} {_f(row['tpot_ms_p50'], '.1f', 7)} "
            f"{_f(row['tpot_ms_p99'], '.1f', 7)} {_f(row['e2e_ms_p50'], '.0f', 7)} {_f(row['mean_accepted_len'], '.2f', 7)} "
            f"{_f(row['acceptance_rate'], '.2f', 6)} {_f(row['verifier_busy'], '.2f', 5)} {_f(row['drafter_busy'], '.2f', 5)} "
            f"{ident:>6}")
    parts = [r for r in doc["systems"] if r.get("round_ms") and r["mode"] == "closed" and r["concurrency"] == 1]
    if parts:
        lines += ["", "where a round's time goes at c=1 (ms per round; draft: per drafting round, as fusion measured it; "
                  "a decode run of several plain tokens is one round):",
                  f"{'system':17} {'rounds':>6} {'tok/rnd':>7} {'draft':>7} {'verify':>7} {'commit':>7} {'gRPC+queue':>10}"]
        for r in parts:
            b = r["round_ms"]
            lines.append(f"{r['name']:17} {b['rounds']:6d} {_f(r['tokens'] / b['rounds'] if b['rounds'] else None, '.2f', 7)} "
                         f"{b['draft_ms']:7.1f} {b['verify_ms']:7.1f} {b['commit_ms']:7.1f} {b['overhead_ms']:10.1f}")
    steps = [r for r in doc["systems"] if r.get("step_ms")]
    if steps:
        lines += ["", "where a verification step's time goes (ms per step; step: send to answer at the scheduler, of which "
                  "the verifier's model thread (prefills of new requests included) and gRPC/queueing; between: commit, "
                  "streaming, choice, waiting for drafts; verify: the model thread's verification steps alone):",
                  f"{'system':17} {'load':>9} {'steps':>6} {'batch':>6} {'wall':>7} {'step':>7} {'model':>7} "
                  f"{'gRPC+q':>7} {'between':>7} {'verify':>7}"]
        for r in steps:
            b = r["step_ms"]
            lines.append(f"{r['name']:17} {_point_label((r['mode'], r['concurrency'], r['rate'])):>9} {b['steps']:6d} "
                         f"{b['mean_batch']:6.2f} {b['wall_per_step_ms']:7.1f} {b['step_ms']:7.1f} "
                         f"{b['verifier_model_ms']:7.1f} {b['grpc_queue_ms']:7.1f} {b['between_steps_ms']:7.1f} "
                         f"{_f(b.get('verifier_step_ms'), '.1f', 7)}")
    if doc.get("accepted_len_by_drafter"):
        lines += ["", "accepted length (tokens per round) per domain, each drafter alone at fixed depth:"]
        ds = sorted({d for per in doc["accepted_len_by_drafter"].values() for d in per})
        lines.append(f"{'drafter':14}" + "".join(f"{d:>10}" for d in ds))
        for name, per in doc["accepted_len_by_drafter"].items():
            lines.append(f"{name:14}" + "".join(_f(per.get(d), '.2f', 10) for d in ds))
    if doc.get("notes"):
        lines += ["", "notes:"] + [f"- {n}" for n in doc["notes"]]
    lines.append(f"\nduration {doc['duration_s']:.0f} s; {doc['machine']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
