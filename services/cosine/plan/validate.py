"""`cosine plan --validate`: the local cluster and the simulator on the same workload, side by side.

1. Start the local cluster (the benchmark's `Cluster`, the same settings `cosine bench compare` uses).
2. Calibrate (`fit_cluster`): plain decoding at concurrency 1 and 8, and each drafter alone at a
   fixed depth at concurrency 1 — the last also records the acceptance trace
   (`cosine.plan.traces.record`). The costs are fitted from the services' Prometheus metrics
   between scrapes: the verifier's model time per batch against its batch size and tree size,
   the gRPC time around a step, the scheduler's time between steps, the Redis commit, each
   drafter's compute per drafted token and the round trip around it; the verifier's prefill is the
   plain c=1 run's TTFT left over after the rest of its simulated path, and each drafter's prefill
   what its own fixed-depth run's TTFT leaves over in the same way. On one machine the LM drafters
   and the verifier share the CPU cores: the simulated deployment shares them by processor sharing
   (`sim.SharedCPU`, the cluster's torch threads per process).
3. Measure the validated system (cosine-full: routing, confidence fusion, adaptive depth,
   pipelining) at each concurrency, closed loop, twice: before and after the calibration (their
   difference shows how much the machine moved meanwhile); simulate the same prompts, order and
   concurrency with the fitted costs and the recorded trace; report both and the relative error
   against the mean of the two measurements.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from cosine.bench import client
from cosine.bench import stats as S
from cosine.plan.costs import Costs, Link
from cosine.plan.sim import Deployment, SimPrompt, simulate

FULL = {"fusion": 1, "routing": True, "adaptive_depth": True, "pipelining": True}  # FUSION_MODE_CONFIDENCE = 1
PLAIN = {"disabled": True}


def scrape(port: int, tries: int = 5) -> dict:
    """A service's metrics; on a loaded machine a scrape can time out, and a missing scrape would spoil a delta."""
    import urllib.request

    for attempt in range(tries):
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            return client.parse_metrics(body)
        except OSError:
            time.sleep(1 + attempt)
    raise RuntimeError(f"could not scrape the metrics on port {port} after {tries} tries")


def snapshot(ports: dict) -> dict:
    v = scrape(ports["verifier"])
    s = scrape(ports["scheduler"])
    drafters = {f"busy:{name}": client.metric_sum(scrape(port), "cosine_worker_busy_seconds_total")
                for name, port in ports.get("drafters", {}).items()}
    return {**drafters,"verifier_busy": client.metric_sum(v, "cosine_worker_busy_seconds_total"),
            "batch_sum": v.get("cosine_verifier_batch_size_sum", 0.0), "batch_count": v.get("cosine_verifier_batch_size_count", 0.0),
            "tokens_sum": v.get("cosine_verifier_batch_tokens_sum", 0.0),
            "step_sum": s.get("cosine_scheduler_step_seconds_sum", 0.0), "step_count": s.get("cosine_scheduler_step_seconds_count", 0.0),
            "commit_sum": s.get("cosine_scheduler_commit_seconds_sum", 0.0), "rounds": s.get("cosine_scheduler_rounds_total", 0.0),
            "draft_sum": s.get("cosine_scheduler_draft_seconds_sum", 0.0), "draft_count": s.get("cosine_scheduler_draft_seconds_count", 0.0),
            "draft_compute_sum": s.get("cosine_scheduler_draft_compute_seconds_sum", 0.0),
            "drafted": s.get("cosine_scheduler_drafted_tokens_total", 0.0),
            "depth_sum": s.get("cosine_scheduler_depth_sum", 0.0), "depth_count": s.get("cosine_scheduler_depth_count", 0.0)}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


CALIBRATION = ("plain1", "plain8", "spread8")  # and "drafter:<name>"


def nonnegative_lstsq(X: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient ≥ 0 (a time model's costs): drop the most negative coefficient and
    refit until none is negative (an active-set method; exact for the few features here)."""
    active = list(range(X.shape[1]))
    while active:
        coef, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (coef >= 0).all():
            out = [0.0] * X.shape[1]
            for i, c in zip(active, coef):
                out[i] = float(c)
            return out
        active.pop(int(np.argmin(coef)))
    return [0.0] * X.shape[1]


def fit_cluster(runs: dict, depth: int, prompt_len: float, max_new: int) -> tuple[Costs, dict]:
    """Costs from the calibration runs' metric deltas: runs = {"plain1": (delta, wall, records, prompt tokens), ...}
    (plain decoding at c=1 and 8, each drafter alone at fixed depth at c=1, one at c=8: "spread8").
    Returns the costs and the figures they came from. The validated system's runs are never used."""
    calib = {k: v for k, v in runs.items() if k in CALIBRATION or k.startswith("drafter:")}
    points, figures = [], {}
    context = prompt_len + max_new / 2  # the mean context of a step over a request's life
    for name, (d, wall, _, _) in calib.items():
        if d["batch_count"] <= 0:
            continue
        b = d["batch_sum"] / d["batch_count"]
        positions = d["tokens_sum"] / d["batch_count"]  # Σ (1 + tree) per step
        t = d["verifier_busy"] / d["batch_count"]
        trees = min(1.0, d["draft_count"] / max(1.0, d["step_count"]))  # steps with a draft tree in them
        points.append((b, positions, trees, t))
        figures[name] = {"mean_batch": round(b, 2), "positions_per_step": round(positions, 2), "verifier_ms_per_step": round(t * 1000, 2),
                         "errors": sum(1 for r in runs[name][2] if r.error)}
    # VerifyTimeModel's features [1, b(d+1), bL, b(d+1)L]: positions stand for b(d+1); the last term is left at 0;
    # plus a fixed cost for a step with a tree (the native engine's tree-attention path costs more than decoding)
    X = np.array([[1.0, p, b * context, trees] for b, p, trees, _ in points])
    y = np.array([t for *_, t in points])
    c0, c1, c2, c_tree = nonnegative_lstsq(X, y)
    d1, wall1, _, _ = runs["plain1"]
    steps = max(1.0, d1["step_count"])
    model_s = d1["verifier_busy"] / max(1.0, d1["batch_count"])
    grpc_s = max(0.0, d1["step_sum"] / steps - model_s)
    commit_s = d1["commit_sum"] / max(1.0, d1["rounds"])
    between = max(0.0, wall1 / steps - d1["step_sum"] / steps - commit_s)
    drafters, prefill, drafter_rtt = {}, {}, []
    for name, (d, _, _, prompt_tokens) in calib.items():
        if not name.startswith("drafter:") or d["draft_count"] <= 0:
            continue
        drafter = name.split(":", 1)[1]
        per_round = d["draft_compute_sum"] / d["draft_count"]
        tokens = max(1.0, d["drafted"] / d["draft_count"])
        drafters[drafter] = [0.0, per_round / tokens, 0.0, 0.0]
        busy = d.get(f"busy:{drafter}", 0.0)
        drafter_rtt.append(max(0.0, (d["draft_sum"] - d["draft_compute_sum"]) / d["draft_count"]))
        figures[name].update({"draft_ms_per_round": round(per_round * 1000, 2), "tokens_per_round": round(tokens, 2),
                              "round_trip_ms": round(drafter_rtt[-1] * 1000, 2), "drafter_busy_s": round(busy, 3)})
    costs = Costs(verify=[float(c0), float(c1), float(c2), 0.0], verify_tree_s=float(c_tree), prefill=[0.0, 0.0], drafters=drafters,
                  drafter_prefill=prefill, commit_s=commit_s, scheduler_step_s=between,
                  links={"verifier": Link(grpc_s / 2), "drafter": Link((float(np.mean(drafter_rtt)) if drafter_rtt else 0.0) / 2),
                         "internal": Link(0.0)},
                  source="fitted from the local cluster's Prometheus metrics (calibration runs: plain c=1 and c=8, "
                         f"each drafter alone at depth {depth} c=1, one at c=8)")
    figures["fit"] = {"verify_fixed_ms": round(float(c0) * 1000, 3), "verify_per_position_ms": round(float(c1) * 1000, 3),
                      "verify_per_request_token_of_context_us": round(float(c2) * 1e6, 4),
                      "verify_tree_step_ms": round(float(c_tree) * 1000, 3),
                      "verifier_grpc_ms": round(grpc_s * 1000, 3), "commit_ms": round(commit_s * 1000, 3),
                      "between_steps_ms": round(between * 1000, 3)}
    return costs, figures


def _mean_of(a: dict, b: dict) -> dict:
    """The two measurements of a point, averaged figure by figure (the first's for what is not a number)."""
    out = dict(b)
    for k, v in a.items():
        if isinstance(v, (int, float)) and isinstance(b.get(k), (int, float)) and not isinstance(v, bool):
            out[k] = (v + b[k]) / 2
    return out


def _ratio(d: dict, num: str, den: str) -> float | None:
    return d[num] / d[den] if d.get(den) else None


def _step_ms(d: dict) -> float | None:
    return d["verifier_busy"] / d["batch_count"] * 1000 if d["batch_count"] > 0 else None


def _mean_batch(d: dict) -> float | None:
    return d["batch_sum"] / d["batch_count"] if d["batch_count"] > 0 else None


def sim_prompts(workload, tok, max_new: int) -> list[SimPrompt]:
    return [SimPrompt(p.domain, len(p.token_ids(tok)), max_new) for p in workload]


def run(args, progress) -> dict:
    from transformers import AutoTokenizer

    from cosine.bench.workload import build_workload
    from cosine.cluster import Cluster, ClusterSpec, free_port, zoo_drafters
    from cosine.bench.compare import sweep_speculation
    from cosine.plan.traces import record
    from cosine.zoo.registry import TARGET, cache_root, path_of

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workload = build_workload(args.per_domain, args.seed, cache_root())
    tok = AutoTokenizer.from_pretrained(str(path_of(TARGET)))
    prompts = sim_prompts(workload, tok, args.max_new_tokens)
    specs = zoo_drafters()
    candidates = [d.name for d in specs if d.default]
    os.environ["COSINE_RUN_DIR"] = tempfile.mkdtemp(prefix="cosine-plan-run-")
    slots = str(max(16, max(args.concurrency) + 8))
    os.environ["COSINE_VERIFIER_MAX_SLOTS"] = os.environ["COSINE_DRAFTER_MAX_REQUESTS"] = slots
    os.environ["COSINE_ROUTER_MAX_STREAMS"] = slots
    os.environ.setdefault("COSINE_VERIFIER_MAX_CONTEXT", "2048")
    os.environ["COSINE_DRAFTER_MEMORY_TOKENS"] = "0"  # as bench compare: repeated prompts would replay answers
    cluster = Cluster(ClusterSpec(router_port=free_port(), drafters=specs))
    runs, measured = {}, {}
    started = time.time()
    try:
        progress.phase("starting the local cluster")
        cluster.start()
        procs = {p.name: p for p in cluster.processes}
        ports = {"verifier": procs["verifier"].metrics_port, "scheduler": procs["scheduler"].metrics_port,
                 "drafters": {d.name: procs[f"drafter-{d.name}"].metrics_port for d in specs}}
        addr = cluster.router_address
        progress.phase("warm-up")
        for w in (PLAIN, {"drafters": [d.name for d in specs], "fusion": 2, "max_depth": 2}):
            client.closed_loop(addr, workload, [0], w, 1, 8)

        def measure(key, speculation, conc, max_new):
            order = S.request_order(len(workload), max(len(workload), 2 * conc))
            before = snapshot(ports)
            records, wall = client.closed_loop(addr, workload, order, speculation, conc, max_new)
            runs[key] = (delta(before, snapshot(ports)), wall, records, sum(prompts[p].prompt_len for p in order))
            return records, wall, order

        # the validated system is measured twice, before and after the calibration, so that the report shows how
        # much the machine itself moved (other work on shared cores) next to the simulator's error
        first = {}
        for conc in args.concurrency:
            progress.phase(f"measuring cosine-full c={conc} (first of two)")
            records, wall, order = measure(f"full{conc}-a", FULL, conc, args.max_new_tokens)
            first[conc] = S.summarise("cosine-full", records, None, concurrency=conc, wall_s=wall)
        progress.phase("calibration: plain decoding c=1")
        measure("plain1", PLAIN, 1, args.max_new_tokens)
        progress.phase("calibration: plain decoding c=8")
        measure("plain8", PLAIN, 8, args.max_new_tokens)
        spread = next((d.name for d in specs if d.kind == "ngram"), specs[0].name)
        progress.phase(f"calibration: {spread} alone at depth {args.trace_depth}, c=8")
        measure("spread8", sweep_speculation(spread, args.trace_depth), 8, args.max_new_tokens)
        trace = None
        for d in specs:
            progress.phase(f"recording the acceptance trace of {d.name} (alone, depth {args.trace_depth})")
            b = snapshot(ports)
            tr, rec = record(addr, workload, [d.name], args.trace_depth, args.max_new_tokens)
            runs[f"drafter:{d.name}"] = (delta(b, snapshot(ports)), 0.0, rec[d.name], sum(p.prompt_len for p in prompts))
            if trace is None:
                trace = tr
            else:
                trace.rounds.update(tr.rounds)
        for conc in args.concurrency:
            progress.phase(f"measuring cosine-full c={conc} (second of two)")
            records, wall, order = measure(f"full{conc}", FULL, conc, args.max_new_tokens)
            dv = runs[f"full{conc}"][0]
            second = S.summarise("cosine-full", records, None, concurrency=conc, wall_s=wall, verifier_busy_s=dv["verifier_busy"])
            measured[conc] = (_mean_of(first[conc], second), order, (first[conc], second))
    finally:
        progress.phase("stopping the cluster")
        cluster.stop()
    mean_prompt = sum(p.prompt_len for p in prompts) / len(prompts)
    costs, figures = fit_cluster(runs, args.trace_depth, mean_prompt, args.max_new_tokens)
    # one machine: the verifier's torch threads and the LM drafters' share its cores (processor sharing); the
    # calibration runs measured each alone (plain decoding; a drafter and the verifier taking turns at c=1)
    spec = ClusterSpec()
    shared = {"cores": os.cpu_count() or 1,
              "threads": {"verifier": spec.verifier_threads, **{d.name: spec.drafter_threads for d in specs if d.kind == "lm"}}}
    figures["fit"]["cpu"] = shared
    deployment = Deployment(drafters={d.name: 1 for d in specs}, candidates=candidates, speculation=FULL, cpu=shared)
    # the verifier's prefill: what plain c=1's TTFT leaves over once the rest of the simulated path is accounted for
    plain_sim = simulate(Deployment(drafters={d.name: 1 for d in specs}, candidates=candidates, speculation=PLAIN,
                                    cpu=shared), costs, trace, prompts, concurrency=1,
                         order=S.request_order(len(prompts), len(prompts)))
    plain_meas = S.summarise("plain", runs["plain1"][2], None, wall_s=runs["plain1"][1])
    residual = max(0.0, ((plain_meas["ttft_ms_p50"] or 0) - (plain_sim["ttft_ms_p50"] or 0)) / 1000)
    costs.prefill = [0.0, residual / mean_prompt]
    figures["fit"]["verifier_prefill_ms_per_prompt_token"] = round(residual / mean_prompt * 1000, 4)
    # each drafter's prefill, the same way: its fixed-depth run's TTFT left over once the rest is simulated
    # (the first draft waits for the drafter to prefill the prompt)
    for d in specs:
        name = f"drafter:{d.name}"
        one = simulate(Deployment(drafters={x.name: 1 for x in specs}, candidates=candidates,
                                  speculation=sweep_speculation(d.name, args.trace_depth), cpu=shared),
                       costs, trace, prompts, concurrency=1, order=list(range(len(prompts))))
        meas = S.summarise(d.name, runs[name][2], None, wall_s=1.0)
        left = max(0.0, ((meas["ttft_ms_p50"] or 0) - (one["ttft_ms_p50"] or 0)) / 1000)
        costs.drafter_prefill[d.name] = left / mean_prompt
        figures[name]["prefill_ms_per_prompt_token"] = round(left / mean_prompt * 1000, 4)
    progress.phase("simulating")
    rows = []
    for conc in args.concurrency:
        m, order, (ma, mb) = measured[conc]
        s = simulate(deployment, costs, trace, prompts, concurrency=conc, order=order)
        rows.append({"concurrency": conc,
                     "measured_tokens_per_s": m["tokens_per_s"], "simulated_tokens_per_s": s["tokens_per_s"],
                     "measured_ttft_ms_p50": m["ttft_ms_p50"], "simulated_ttft_ms_p50": s["ttft_ms_p50"],
                     "measured_tpot_ms_p50": m["tpot_ms_p50"], "simulated_tpot_ms_p50": s["tpot_ms_p50"],
                     "measured_accepted_len": m["mean_accepted_len"], "simulated_accepted_len": s["mean_accepted_len"],
                     "measured_mean_step": _mean_batch(runs[f"full{conc}"][0]),
                     "measured_mean_depth": _ratio(runs[f"full{conc}"][0], "depth_sum", "depth_count"),
                     "simulated_mean_depth": sum(d[1] for d in s["decisions"]) / len(s["decisions"]) if s["decisions"] else None,
                     "simulated_mean_step": (sum(s["steps"]) / len(s["steps"])) if s["steps"] else None,
                     "measured_verifier_busy": m["verifier_busy"], "simulated_verifier_busy": s["verifier_busy"],
                     "measured_verifier_ms_per_step": _step_ms(runs[f"full{conc}"][0]),
                     "simulated_verifier_ms_per_step": s["verifier_busy"] * s["simulated_s"] / len(s["steps"]) * 1000 if s["steps"] else None,
                     "errors": (ma.get("errors") or 0) + (mb.get("errors") or 0),
                     "measured_runs": [{k: x[k] for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50")} for x in (ma, mb)],
                     "measured_spread_tokens_per_s": abs(ma["tokens_per_s"] - mb["tokens_per_s"]) / m["tokens_per_s"]
                     if m["tokens_per_s"] else None})
        for key in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50"):
            a, b = rows[-1][f"measured_{key}"], rows[-1][f"simulated_{key}"]
            rows[-1][f"error_{key}"] = (b - a) / a if a and b is not None else None
    return {"validation": rows, "costs": costs.to_dict(), "calibration": figures,
            "trace": {"depth": trace.depth, "source": trace.source,
                      "mean_accepted": {d: round(trace.mean_accepted(d), 3) for d in trace.rounds}},
            "trace_rounds": trace.rounds,
            "workload": {"prompts": len(workload), "max_new_tokens": args.max_new_tokens},
            "duration_s": round(time.time() - started, 1)}


def format_table(doc: dict) -> str:
    lines = ["cosine-full, closed loop: measured on the local cluster (mean of two runs, before and after the calibration; "
             "tok/s runs: each) vs simulated (same prompts, order, concurrency)",
             f"{'conc':>4} {'tok/s meas':>10} {'tok/s sim':>9} {'err':>6} {'TTFT50 m':>9} {'TTFT50 s':>9} {'err':>6} "
             f"{'TPOT50 m':>9} {'TPOT50 s':>9} {'err':>6} {'acc/rnd m':>9} {'acc/rnd s':>9} {'tok/s runs':>14}"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in doc["validation"]:
        lines.append(f"{r['concurrency']:>4} {f(r['measured_tokens_per_s'], '10.1f')} {f(r['simulated_tokens_per_s'], '9.1f')} "
                     f"{f(r['error_tokens_per_s'], '+6.0%')} {f(r['measured_ttft_ms_p50'], '9.1f')} {f(r['simulated_ttft_ms_p50'], '9.1f')} "
                     f"{f(r['error_ttft_ms_p50'], '+6.0%')} {f(r['measured_tpot_ms_p50'], '9.1f')} {f(r['simulated_tpot_ms_p50'], '9.1f')} "
                     f"{f(r['error_tpot_ms_p50'], '+6.0%')} {f(r['measured_accepted_len'], '9.2f')} {f(r['simulated_accepted_len'], '9.2f')} "
                     f"{' / '.join(f(x['tokens_per_s'], '.1f') for x in r['measured_runs']):>14}")
    lines.append(f"calibration: {doc['calibration'].get('fit')}")
    lines.append(f"trace: {doc['trace']['source']}; mean accepted per round {doc['trace']['mean_accepted']}")
    return "\n".join(lines)
