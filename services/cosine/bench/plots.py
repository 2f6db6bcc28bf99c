"""PNG figures of a `cosine bench` report (matplotlib, Agg; skipped with a note when matplotlib is missing)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def load_curves(systems: list[dict], mode: str = "closed") -> dict[str, list[dict]]:
    """Rows of each system in `mode`, sorted by concurrency (closed) or rate (poisson)."""
    key = "concurrency" if mode == "closed" else "rate"
    curves: dict[str, list[dict]] = {}
    for row in systems:
        if row.get("mode") == mode and row.get(key) is not None and row.get("tokens_per_s") is not None:
            curves.setdefault(row["name"], []).append(row)
    return {name: sorted(rows, key=lambda r: r[key]) for name, rows in curves.items()}


def plot_load(systems: list[dict], path: Path) -> Path | None:
    """Throughput, mean TPOT and p50 end-to-end latency against concurrency, one line per system."""
    plt = _plt()
    curves = load_curves(systems)
    if plt is None or not curves:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = plt.get_cmap("tab20").colors
    for i, (name, rows) in enumerate(curves.items()):
        xs = [r["concurrency"] for r in rows]
        style = {"marker": "o", "color": colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20],
                 "linestyle": "--" if name.startswith(("target", "hf-")) else "-"}
        axes[0].plot(xs, [r["tokens_per_s"] for r in rows], label=name, **style)
        axes[1].plot(xs, [r["tpot_ms_mean"] for r in rows], label=name, **style)
        axes[2].plot(xs, [(r["e2e_ms_p50"] or 0) / 1000 for r in rows], label=name, **style)
    for ax, title in zip(axes, ("output tokens/s", "mean time per output token (ms)", "end-to-end latency p50 (s)")):
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accepted(by_drafter: dict[str, dict[str, float]], path: Path) -> Path | None:
    """Mean tokens per round (accepted + 1) per domain, one bar group per domain, one bar per drafter."""
    plt = _plt()
    if plt is None or not by_drafter:
        return None
    domains = sorted({d for per in by_drafter.values() for d in per})
    names = list(by_drafter)
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(domains))]
        ax.bar(xs, [by_drafter[name].get(d, 0.0) for d in domains], width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(domains))])
    ax.set_xticklabels(domains)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("tokens per round (accepted + 1)")
    ax.set_title("accepted length per domain, per drafter (single drafter, fixed depth)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
