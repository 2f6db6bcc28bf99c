"""Turn a locust run's CSVs into a summary table (stdout, and PREFIX_summary.md) and a PNG plot.

    python loadtest/summarize.py loadtest/results/cosine      # reads cosine_stats.csv, cosine_stats_history.csv

The table: per request event (TTFT, inter-token, stream), requests, failures and
latency percentiles in milliseconds. The plot: those percentiles per event, and
users and requests per second over the run.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

PERCENTILES = ("50%", "90%", "95%", "99%")


def read_stats(prefix: str) -> list[dict]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return list(csv.DictReader(f))


def read_history(prefix: str) -> list[dict]:
    path = Path(f"{prefix}_stats_history.csv")
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):  # "N/A" before the first request
        return None


def summary_rows(stats: list[dict]) -> list[dict]:
    rows = []
    for row in stats:
        name = row["Name"]
        rows.append({
            "event": name,
            "requests": int(row["Request Count"]),
            "failures": int(row["Failure Count"]),
            "mean_ms": _number(row["Average Response Time"]),
            **{f"p{p.rstrip('%')}_ms": _number(row[p]) for p in PERCENTILES},
            "max_ms": _number(row["Max Response Time"]),
            "per_s": _number(row["Requests/s"]),
        })
    return rows


def table(rows: list[dict]) -> str:
    cols = ["event", "requests", "failures", "mean_ms", *(f"p{p.rstrip('%')}_ms" for p in PERCENTILES), "max_ms", "per_s"]

    def fmt(v) -> str:
        if v is None:
            return "-"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], history: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [r for r in rows if r["event"] != "Aggregated"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(PERCENTILES)
    for i, p in enumerate(PERCENTILES):
        key = f"p{p.rstrip('%')}_ms"
        ax1.bar([j + i * width for j in range(len(events))], [r[key] or 0 for r in events], width, label=f"p{p.rstrip('%')}")
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(events))], [r["event"].removeprefix("Generate ") for r in events])
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.set_title("latency percentiles per event")
    ax1.legend()
    agg = [h for h in history if h["Name"] == "Aggregated"]
    if agg:
        t0 = int(agg[0]["Timestamp"])
        ts = [int(h["Timestamp"]) - t0 for h in agg]
        ax2.plot(ts, [int(h["User Count"]) for h in agg], label="users")
        stream = [h for h in history if h["Name"] == "Generate stream"]
        if stream:
            ax2.plot([int(h["Timestamp"]) - t0 for h in stream], [_number(h["Requests/s"]) or 0 for h in stream], label="streams/s")
        ax2.set_xlabel("s")
        ax2.set_title("load over the run")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the --csv prefix of the locust run")
    parser.add_argument("--png", default=None, help="plot path (default PREFIX_summary.png)")
    args = parser.parse_args(argv)
    rows = summary_rows(read_stats(args.prefix))
    text = table(rows)
    print(text)
    Path(f"{args.prefix}_summary.md").write_text(text + "\n")
    png = Path(args.png or f"{args.prefix}_summary.png")
    plot(rows, read_history(args.prefix), png)
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
