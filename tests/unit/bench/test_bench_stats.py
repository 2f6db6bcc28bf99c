"""`cosine bench`: statistics, ratios, the JSON shape, arrival schedules, token timing of generate() steps."""

from __future__ import annotations

import json
import math

import pytest

from cosine.bench import stats as S


def rec(i, arrival, times, ids, rounds=None, drafted=None, accepted=None, domain="code", end=None):
    return S.RequestRecord(prompt_index=i, domain=domain, arrival_s=arrival, token_times_s=list(times), token_ids=list(ids),
                           end_s=end, rounds=rounds, drafted=drafted, accepted=accepted)


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert S.percentile(xs, 50) == 2.5
    assert S.percentile(xs, 0) == 1.0 and S.percentile(xs, 100) == 4.0
    assert S.percentile(xs, 99) == pytest.approx(3.97)
    assert S.percentile([7.0], 99) == 7.0
    assert S.percentile([], 50) is None
    assert S.percentile([None, 2.0], 50) == 2.0
    with pytest.raises(ValueError):
        S.percentile([1.0], 101)


def test_request_timings():
    r = rec(0, 1.0, [1.5, 1.6, 1.8], [1, 2, 3], end=2.0)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.15)  # (1.8 - 1.5) / 2
    assert r.e2e_s == pytest.approx(1.0)
    one = rec(0, 0.0, [0.2], [9])
    assert one.tpot_s is None and one.e2e_s == pytest.approx(0.2)
    assert rec(0, 0.0, [], []).ttft_s is None


def test_summarise_figures_and_identical_outputs():
    refs = {0: [1, 2, 3, 4], 1: [5, 6]}
    records = [rec(0, 0.0, [0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4], rounds=2, drafted=6, accepted=2, domain="code"),
               rec(1, 0.0, [0.2, 0.6], [5, 7], rounds=2, drafted=2, accepted=0, domain="chat")]
    row = S.summarise("x", records, refs, concurrency=2, wall_s=2.0, verifier_busy_s=1.5, drafter_busy_s=0.5)
    assert row["tokens"] == 6 and row["tokens_per_s"] == 3.0
    assert row["identical_outputs"] == 1 and row["prompts"] == 2
    assert row["mean_accepted_len"] == 1.5  # 6 tokens / 4 rounds
    assert row["acceptance_rate"] == pytest.approx(2 / 8)
    assert row["verifier_busy"] == 0.75 and row["drafter_busy"] == 0.25
    assert row["ttft_ms_p50"] == pytest.approx(150.0)
    assert row["tpot_ms_p50"] == pytest.approx(250.0)  # median of 100 and 400 ms
    assert row["accepted_len_by_domain"] == {"chat": 1.0, "code": 2.0}


def test_summarise_without_speculation_counters_or_wall_time():
    records = [rec(0, 1.0, [1.2, 1.3], [1, 2], end=1.4), rec(1, 2.0, [2.5], [3], end=3.0)]
    row = S.summarise("target-only", records, None)
    assert row["wall_s"] == pytest.approx(2.0)  # first arrival 1.0 to last end 3.0
    assert row["mean_accepted_len"] is None and row["acceptance_rate"] is None
    assert row["verifier_busy"] is None and row["identical_outputs"] is None


def test_failed_requests_count_as_errors_not_tokens():
    bad = rec(1, 0.0, [], [])
    bad.error = "UNAVAILABLE: down"
    row = S.summarise("x", [rec(0, 0.0, [0.1], [1], end=0.5), bad], {0: [1], 1: [2]}, wall_s=1.0)
    assert row["errors"] == 1 and row["tokens"] == 1 and row["identical_outputs"] == 1 and row["prompts"] == 2


def row(name, tps, tpot=10.0, conc=1, mode="closed", rate=None):
    return {"name": name, "tokens_per_s": tps, "tpot_ms_mean": tpot, "mode": mode, "concurrency": conc, "rate": rate}


def test_ratios_are_taken_at_the_same_load_point():
    rows = [row("target-only", 10.0), row("vanilla-sd", 20.0, 8.0), row("cosine-full", 30.0, 6.0),
            row("target-only", 40.0, conc=8), row("cosine-full", 60.0, conc=8), row("hf-assisted", 5.0, mode="poisson", conc=None, rate=0.5)]
    S.add_ratios(rows)
    full1, full8, hf = rows[2], rows[4], rows[5]
    assert full1["ratio_to_target_only"] == 3.0 and full1["ratio_to_vanilla_sd"] == 1.5
    assert full1["tpot_ratio_to_vanilla_sd"] == pytest.approx(0.75)
    assert full8["ratio_to_target_only"] == 1.5 and full8["ratio_to_vanilla_sd"] is None
    assert hf["ratio_to_target_only"] is None
    assert rows[0]["ratio_to_target_only"] == 1.0
    assert S.ratio(1.0, 0.0) is None and S.ratio(None, 1.0) is None


def test_report_shape_has_every_key_and_is_json():
    records = [rec(0, 0.0, [0.1, 0.2], [1, 2], rounds=1, drafted=3, accepted=1)]
    rows = [S.summarise("target-only", records, {0: [1, 2]}, wall_s=1.0), S.summarise("cosine-full", records, {0: [1, 2]}, wall_s=0.5)]
    S.add_ratios(rows)
    doc = json.loads(json.dumps(S.report(rows, {"max_new_tokens": 2})))
    assert doc["max_new_tokens"] == 2 and [s["name"] for s in doc["systems"]] == ["target-only", "cosine-full"]
    required = {"name", "concurrency", "tokens_per_s", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "mean_accepted_len",
                "identical_outputs", "prompts", "verifier_busy"}
    for entry in doc["systems"]:
        assert required <= set(entry) and set(S.ROW_KEYS) <= set(entry)
    assert doc["systems"][1]["ratio_to_target_only"] == 2.0
    assert doc["systems"][0]["verifier_busy"] is None
    assert S.check_report(doc) == []
    assert S.check_report({"systems": []}) == ["no `systems` list"]
    broken = {"systems": [{"name": "x", "tokens_per_s": math.nan}]}
    problems = S.check_report(broken)
    assert any("lacks" in p for p in problems) and any("tokens_per_s" in p for p in problems)


def test_poisson_arrivals_are_fixed_by_the_seed_and_have_the_rate():
    a = S.poisson_arrivals(2000, 4.0, seed=7)
    assert a == S.poisson_arrivals(2000, 4.0, seed=7)
    assert a != S.poisson_arrivals(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        S.poisson_arrivals(3, 0.0, seed=0)


def test_request_order_cycles_the_workload():
    assert S.request_order(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        S.request_order(0, 1)


def test_token_times_from_generate_steps():
    # assisted generation: step 1 gives 1 token (prefill), step 2 adds 3, step 3 adds 2 (one past the sequence's eos)
    steps = [(1.0, 1), (2.0, 4), (3.0, 6)]
    assert S.split_token_times(steps, 5) == [1.0, 2.0, 2.0, 2.0, 3.0]
    assert S.rounds_from_steps(steps, 5) == 3
    assert S.rounds_from_steps(steps, 4) == 2
    assert S.split_token_times([(1.0, 1)], 2) == [1.0, 1.0]
