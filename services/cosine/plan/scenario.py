"""Scenarios with answers: a deployment on given hardware, against vanilla speculative decoding at equal cost,
and sweeps (drafter nodes per verifier, request rate, link speed) with plots and a recommendation table.

A scenario file (JSON, see scenarios/paper.json) gives the hardware (`costs.from_profile`), the links,
fixed overheads, the deployment (`sim.Deployment` fields), the baseline (vanilla speculative decoding:
one drafter on the verifier's own GPUs, fixed depth, no pipelining), prices per node-hour, the
acceptance trace (a file recorded by `cosine plan --validate --json`, with a map from the scenario's
drafter names to recorded drafters) and the workload.

Equal cost: the baseline's throughput is scaled by (CoSine's $/h) / (one verifier node's $/h), i.e.
as many verifier nodes as CoSine's money buys, with perfect scaling — generous to the baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

from cosine.bench import stats as S
from cosine.plan.costs import from_profile, link_from
from cosine.plan.sim import Deployment, SimPrompt, simulate
from cosine.plan.traces import AcceptanceTrace

HERE = Path(__file__).parent


def load(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    doc["_path"] = str(path)
    return doc


def trace_of(scenario: dict, base: Path) -> AcceptanceTrace:
    t = scenario["trace"]
    path = Path(t["file"])
    recorded = AcceptanceTrace.load(path if path.is_absolute() else base / path)
    mapped = AcceptanceTrace(recorded.depth, {}, recorded.source + "; mapped " + json.dumps(t.get("map", {})))
    for name, source in t.get("map", {}).items():
        mapped.rounds[name] = recorded.rounds[source]
    for name, per in recorded.rounds.items():
        mapped.rounds.setdefault(name, per)
    return mapped


def prompts_of(scenario: dict, n: int | None = None) -> list[SimPrompt]:
    w = scenario["workload"]
    out = [SimPrompt(p["domain"], p["prompt_len"], p["max_new_tokens"]) for p in w["prompts"]]
    return out


def spread(kinds: list[str], nodes: int) -> dict[str, int]:
    """`nodes` drafter nodes over the drafter kinds, round robin (fewer nodes than kinds: the first kinds only)."""
    out: dict[str, int] = {}
    for i in range(nodes):
        out[kinds[i % len(kinds)]] = out.get(kinds[i % len(kinds)], 0) + 1
    return out


def cosine_deployment(scenario: dict, nodes: int | None = None) -> Deployment:
    d = scenario["deployment"]
    kinds = list(d["drafters"])
    drafters = dict(d["drafters"]) if nodes is None else spread(kinds, nodes)
    return Deployment(schedulers=d.get("schedulers", 1), verifiers=d.get("verifiers", 1), drafters=drafters,
                      candidates=[k for k in kinds if drafters.get(k)], speculation=d["speculation"] if drafters else {"disabled": True},
                      scheduler=d.get("scheduler", {}))


def fixed_depth_deployment(scenario: dict, depth: int = 4) -> Deployment:
    """CoSine with adaptive depth off (every round drafts `depth`): what drafting costs when it always runs."""
    d = cosine_deployment(scenario)
    d.speculation = {**d.speculation, "adaptive_depth": False, "max_depth": depth}
    return d


def baseline_deployment(scenario: dict) -> Deployment:
    b = scenario["baseline"]
    return Deployment(schedulers=1, verifiers=1, drafters={b["drafter"]: 1}, candidates=[b["drafter"]],
                      speculation=b["speculation"], scheduler=scenario["deployment"].get("scheduler", {}), colocated=True)


def hourly(scenario: dict, deployment: Deployment) -> float:
    p = scenario["prices_per_hour"]
    if deployment.colocated:
        return p["verifier_node"] * deployment.verifiers
    return p["verifier_node"] * deployment.verifiers + p["drafter_node"] * sum(deployment.drafters.values())


def point(scenario, deployment, costs, trace, prompts, *, rate=None, concurrency=None, n=None, seed=0) -> dict:
    n = n or scenario["workload"].get("requests", 64)
    order = S.request_order(len(prompts), n)
    arrivals = S.poisson_arrivals(n, rate, seed) if rate else None
    row = simulate(deployment, costs, trace, prompts, concurrency=concurrency, order=order, arrivals=arrivals, seed=seed)
    cost = hourly(scenario, deployment)
    keep = {k: row[k] for k in ("tokens_per_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p50", "mean_accepted_len",
                                "verifier_busy", "drafter_busy")}
    keep["dollars_per_hour"] = cost
    keep["tokens_per_dollar"] = row["tokens_per_s"] * 3600 / cost if cost else None
    keep["mean_step"] = sum(row["steps"]) / len(row["steps"]) if row["steps"] else None
    return keep


def run(path: Path, args, progress) -> dict:
    scenario = load(path)
    base = Path(path).parent
    costs = from_profile(scenario)
    base_costs = from_profile(scenario, drafters_on_verifier=True)
    trace = trace_of(scenario, base)
    prompts = prompts_of(scenario)
    w = scenario["workload"]
    n = w.get("requests", 64) if not args.quick else min(32, w.get("requests", 64))
    progress.phase("simulating the scenario")
    cos, van = cosine_deployment(scenario), baseline_deployment(scenario)
    results = []
    for conc in w.get("concurrency", [16]):
        c = point(scenario, cos, costs, trace, prompts, concurrency=conc, n=n)
        v = point(scenario, van, base_costs, trace, prompts, concurrency=conc, n=n)
        scale = c["dollars_per_hour"] / v["dollars_per_hour"]
        results.append({"concurrency": conc, "cosine": c, "vanilla_sd": v, "vanilla_nodes_at_equal_cost": round(scale, 3),
                        "vanilla_tokens_per_s_at_equal_cost": v["tokens_per_s"] * scale,
                        "cosine_over_vanilla_at_equal_cost": c["tokens_per_s"] / (v["tokens_per_s"] * scale)})
    doc = {"scenario": scenario.get("name"), "about": scenario.get("about"), "assumptions": scenario.get("assumptions", []),
           "costs_source": costs.source, "baseline_costs_source": base_costs.source,
           "trace": {"source": trace.source, "depth": trace.depth,
                     "mean_accepted": {k: round(trace.mean_accepted(k), 3) for k in scenario["deployment"]["drafters"]}},
           "requests_per_point": n, "results": results}
    if args.sweep:
        doc["sweep"] = sweep(scenario, costs, base_costs, trace, prompts, n, progress)
    return doc


def sweep(scenario, costs, base_costs, trace, prompts, n, progress) -> dict:
    s = scenario["sweep"]
    out = {"drafter_nodes": [], "rate": [], "link_mbps": [], "link_latency_ms": []}
    rate0 = s.get("base_rate", 4.0)
    for k in s["drafter_nodes"]:
        progress.phase(f"sweep: {k} drafter nodes per verifier")
        for rate in s["rate"]:
            r = point(scenario, cosine_deployment(scenario, k), costs, trace, prompts, rate=rate, n=n)
            out["drafter_nodes"].append({"nodes": k, "rate": rate, **r})
    for rate in s["rate"]:
        progress.phase(f"sweep: rate {rate}/s, vanilla speculative decoding")
        r = point(scenario, baseline_deployment(scenario), base_costs, trace, prompts, rate=rate, n=n)
        out["rate"].append({"system": "vanilla-sd", "rate": rate, **r})
        r = point(scenario, cosine_deployment(scenario), costs, trace, prompts, rate=rate, n=n)
        out["rate"].append({"system": "cosine", "rate": rate, **r})
        r = point(scenario, fixed_depth_deployment(scenario), costs, trace, prompts, rate=rate, n=n)
        out["rate"].append({"system": "cosine-fixed-depth", "rate": rate, **r})
    # the drafter links, one property at a time: (sweep key, link field, the key of its value in a row, unit)
    for key, field, column, unit in (("link_mbps", "bandwidth_mbps", "mbps", "Mbps"),
                                     ("link_latency_ms", "latency_ms", "latency_ms", "ms latency")):
        for value in s.get(key, []):
            progress.phase(f"sweep: drafter links at {value} {unit}")
            c = type(costs).from_dict(costs.to_dict())
            c.links["drafter"] = link_from({**scenario["links"]["drafter"], field: value})
            for system, deployment in (("cosine", cosine_deployment(scenario)), ("cosine-fixed-depth", fixed_depth_deployment(scenario))):
                r = point(scenario, deployment, c, trace, prompts, rate=rate0, n=n)
                out[key].append({"system": system, column: value, "rate": rate0, **r})
    out["recommendation"] = recommend(out["drafter_nodes"], s.get("tpot_slack", 0.1))
    return out


def recommend(rows: list[dict], slack: float) -> list[dict]:
    """Per request rate: the fewest drafter nodes whose TPOT p50 is within `slack` of the best TPOT at that rate
    (more nodes than that buy latency nobody sees), with its throughput and tokens per dollar."""
    out = []
    for rate in sorted({r["rate"] for r in rows}):
        at = [r for r in rows if r["rate"] == rate and r["tpot_ms_p50"] is not None]
        if not at:
            continue
        best = min(r["tpot_ms_p50"] for r in at)
        ok = sorted((r for r in at if r["tpot_ms_p50"] <= best * (1 + slack)), key=lambda r: r["nodes"])
        pick = ok[0]
        # the balance point as autoscaling targets (k8s/planner.md): requests a verifier holds there (Little's law:
        # arrival rate x time in the system) and the Draft streams each drafter node serves (routing's 2 per request)
        held = rate * (pick["e2e_ms_p50"] or 0) / 1000
        out.append({"rate": rate, "drafter_nodes_per_verifier": pick["nodes"], "tpot_ms_p50": pick["tpot_ms_p50"],
                    "tokens_per_s": pick["tokens_per_s"], "tokens_per_dollar": pick["tokens_per_dollar"],
                    "best_tpot_ms_p50": best, "verifier_busy": pick["verifier_busy"],
                    "verifier_requests_held": round(held, 2),
                    "drafter_streams_per_node": round(held * 2 / pick["nodes"], 2) if pick["nodes"] else None})
    return out


def plot(doc: dict, path: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = doc["sweep"]
    fig, axes = plt.subplots(2, 4, figsize=(19, 8))
    for rate in sorted({r["rate"] for r in sw["drafter_nodes"]}):
        rows = [r for r in sw["drafter_nodes"] if r["rate"] == rate]
        axes[0][0].plot([r["nodes"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=f"{rate}/s")
        axes[1][0].plot([r["nodes"] for r in rows], [r["tpot_ms_p50"] for r in rows], marker="o", label=f"{rate}/s")
    axes[0][0].set(title="drafter nodes per verifier", ylabel="output tokens/s")
    axes[1][0].set(xlabel="drafter nodes", ylabel="TPOT p50 (ms)")
    for system in ("cosine", "cosine-fixed-depth", "vanilla-sd"):
        rows = [r for r in sw["rate"] if r["system"] == system]
        axes[0][1].plot([r["rate"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=system)
        axes[1][1].plot([r["rate"] for r in rows], [r["tpot_ms_p50"] for r in rows], marker="o", label=system)
    axes[0][1].set(title="request rate (Poisson)", ylabel="output tokens/s")
    axes[1][1].set(xlabel="requests/s", ylabel="TPOT p50 (ms)")
    for system in ("cosine", "cosine-fixed-depth"):
        rows = [r for r in sw["link_mbps"] if r["system"] == system]
        axes[0][2].plot([r["mbps"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=system)
        axes[1][2].plot([r["mbps"] for r in rows], [r["tpot_ms_p50"] for r in rows], marker="o", label=system)
    axes[0][2].legend(fontsize=8)
    for system in ("cosine", "cosine-fixed-depth"):
        rows = [r for r in sw.get("link_latency_ms", []) if r["system"] == system]
        axes[0][3].plot([r["latency_ms"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=system)
        axes[1][3].plot([r["latency_ms"] for r in rows], [r["tpot_ms_p50"] for r in rows], marker="o", label=system)
    axes[0][3].set(title="drafter link latency (one way)", ylabel="output tokens/s")
    axes[1][3].set(xlabel="ms", ylabel="TPOT p50 (ms)")
    axes[0][3].legend(fontsize=8)
    axes[0][2].set(title="drafter link speed", ylabel="output tokens/s", xscale="log")
    axes[1][2].set(xlabel="Mbps", ylabel="TPOT p50 (ms)", xscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[0][1].legend(fontsize=8)
    fig.suptitle(f"cosine plan: {doc.get('scenario')} (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [str(path)]


def format_report(doc: dict) -> str:
    lines = [f"scenario {doc['scenario']}: {doc.get('about', '')}", f"costs: {doc['costs_source']}",
             f"acceptance: {doc['trace']['source']}", f"mean accepted draft tokens per round at depth {doc['trace']['depth']}: "
             f"{doc['trace']['mean_accepted']}", "",
             f"{'conc':>4} {'system':>10} {'tok/s':>8} {'TTFT50':>8} {'TPOT50':>8} {'acc/rnd':>7} {'$/h':>7} {'tok/$':>9}"]
    for r in doc["results"]:
        for name in ("cosine", "vanilla_sd"):
            x = r[name]
            lines.append(f"{r['concurrency']:>4} {name:>10} {x['tokens_per_s']:8.1f} {x['ttft_ms_p50']:8.1f} {x['tpot_ms_p50']:8.2f} "
                         f"{x['mean_accepted_len'] or 0:7.2f} {x['dollars_per_hour']:7.2f} {x['tokens_per_dollar']:9.0f}")
        lines.append(f"     at equal cost vanilla SD gets {r['vanilla_nodes_at_equal_cost']:.2f} verifier nodes: "
                     f"{r['vanilla_tokens_per_s_at_equal_cost']:.1f} tok/s; CoSine/vanilla = {r['cosine_over_vanilla_at_equal_cost']:.2f}")
    if doc.get("sweep"):
        lines += ["", "recommendation (fewest drafter nodes per verifier within 10% of the best TPOT p50 at each rate):",
                  f"{'req/s':>6} {'nodes':>6} {'TPOT50':>8} {'best':>8} {'tok/s':>8} {'tok/$':>9} {'verif busy':>10} "
                  f"{'held/verif':>10} {'streams/node':>12}"]
        for r in doc["sweep"]["recommendation"]:
            spn = r["drafter_streams_per_node"]
            lines.append(f"{r['rate']:>6} {r['drafter_nodes_per_verifier']:>6} {r['tpot_ms_p50']:8.2f} {r['best_tpot_ms_p50']:8.2f} "
                         f"{r['tokens_per_s']:8.1f} {r['tokens_per_dollar']:9.0f} {r['verifier_busy'] or 0:10.2f} "
                         f"{r['verifier_requests_held']:10.2f} {'-' if spn is None else f'{spn:.2f}':>12}")
        lines += ["", "request rate (Poisson):"] + [
            f"  {r['rate']:>5}/s {r['system']:>18}: {r['tokens_per_s']:.1f} tok/s, TPOT p50 {r['tpot_ms_p50']:.2f} ms, "
            f"{r['mean_accepted_len'] or 0:.2f} tokens/round" for r in doc["sweep"]["rate"]]
        lines += ["", "drafter link speed:"] + [
            f"  {r['mbps']:>7} Mbps {r['system']:>18}: {r['tokens_per_s']:.1f} tok/s, TPOT p50 {r['tpot_ms_p50']:.2f} ms"
            for r in doc["sweep"]["link_mbps"]]
        lines += ["", "drafter link latency (one way):"] + [
            f"  {r['latency_ms']:>7} ms {r['system']:>18}: {r['tokens_per_s']:.1f} tok/s, TPOT p50 {r['tpot_ms_p50']:.2f} ms"
            for r in doc["sweep"].get("link_latency_ms", [])]
    return "\n".join(lines)
