"""The load profiles and the CSV summary of loadtest/ (pure logic; locust itself is not imported here)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"loadtest_{name}", ROOT / "loadtest" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


profiles = _load("profiles")
summarize = _load("summarize")


def test_steady_holds_the_users_until_the_run_time():
    assert profiles.steady(0, 4, 2, 30) == (4, 2)
    assert profiles.steady(29.9, 4, 2, 30) == (4, 2)
    assert profiles.steady(30, 4, 2, 30) is None
    assert profiles.steady(1e6, 4, 2, None) == (4, 2)


def test_ramp_climbs_from_one_to_all_users():
    counts = [profiles.ramp(t, 8, 1, 40)[0] for t in range(0, 40, 5)]
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] == 8
    assert profiles.ramp(40, 8, 1, 40) is None


def test_burst_alternates_base_and_peak():
    period, length = profiles.BURST_PERIOD_S, profiles.BURST_LENGTH_S
    assert profiles.burst(0, 8, 1, 60)[0] == 2
    assert profiles.burst(period - length / 2, 8, 1, 60)[0] == 8
    assert profiles.burst(period + 1, 8, 1, 60)[0] == 2
    assert profiles.burst(60, 8, 1, 60) is None


@pytest.mark.parametrize("with_history", [True, False])
def test_summary_table_and_plot(tmp_path, with_history):
    header = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
              "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
              "50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
    rows = [["grpc", "Generate TTFT", "5", "0", "120", "130.5", "100", "200", "0", "0.5", "0", "120", "", "", "", "180", "190", "", "200", "", "", "200"],
            ["", "Aggregated", "5", "0", "120", "130.5", "100", "200", "0", "0.5", "0", "120", "", "", "", "180", "190", "", "200", "", "", "200"]]
    prefix = tmp_path / "run"
    (tmp_path / "run_stats.csv").write_text("\n".join(",".join(f'"{c}"' for c in r) for r in [header, *rows]) + "\n")
    if with_history:
        (tmp_path / "run_stats_history.csv").write_text(
            '"Timestamp","User Count","Type","Name","Requests/s","Failures/s","50%"\n'
            '"100","1","","Aggregated","0.0","0.0","N/A"\n"101","2","grpc","Generate stream","0.5","0.0","120"\n'
            '"101","2","","Aggregated","0.5","0.0","120"\n')
    assert summarize.main([str(prefix)]) == 0
    table = (tmp_path / "run_summary.md").read_text()
    assert "| Generate TTFT | 5 | 0 | 130.5 | 120.0 | 180.0 | 190.0 | 200.0 | 200.0 | 0.5 |" in table
    assert (tmp_path / "run_summary.png").stat().st_size > 0
