"""A headless 30 s locust run of loadtest/locustfile.py against the local cluster: no failures, CSVs written."""

from __future__ import annotations

import csv
import subprocess
import sys

from tests.conftest import ROOT


def test_headless_locust_run_has_no_failures(cluster, tmp_path):
    prefix = tmp_path / "cosine"
    # its own process: locust monkey-patches with gevent, which must not happen inside pytest
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "-u", "2", "-r", "2", "-t", "30s", "--stop-timeout", "90", "--host", cluster["address"],
         "--max-new-tokens", "12", "--csv", str(prefix), "--csv-full-history", "--only-summary"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for suffix in ("_stats.csv", "_stats_history.csv", "_failures.csv", "_exceptions.csv"):
        assert (tmp_path / f"cosine{suffix}").exists(), suffix
    with open(f"{prefix}_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    assert {"Generate TTFT", "Generate inter-token", "Generate stream", "Aggregated"} <= set(stats)
    assert int(stats["Generate stream"]["Request Count"]) >= 2
    assert all(int(row["Failure Count"]) == 0 for row in stats.values())

    summary = subprocess.run([sys.executable, str(ROOT / "loadtest" / "summarize.py"), str(prefix)],
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "Generate TTFT" in summary.stdout
    assert (tmp_path / "cosine_summary.png").stat().st_size > 0
