"""`cosine bench compare`: options, load points, which system runs where, the table, the plots, the workload."""

from __future__ import annotations

import json

import pytest

from cosine.bench import compare, plots
from cosine.bench import stats as S
from cosine.bench.client import metric_sum, parse_metrics
from cosine.bench.workload import DOMAINS, BenchPrompt, interleave


def test_system_names_are_the_ones_outside_checks_read():
    names = set(compare.ALL_SYSTEMS)
    assert {"target-only", "hf-assisted", "hf-prompt-lookup", "vanilla-sd", "no-routing", "no-fusion", "merge-fusion",
            "no-pipeline", "fixed-depth", "cosine-full"} <= names


def test_quick_defaults_and_load_points():
    args = compare.build_args(["--quick"])
    assert args.per_domain == 1 and args.max_new_tokens == 48 and args.concurrency == [1, 4]
    points = compare.load_points(args)
    assert points == [("closed", 1, None), ("closed", 4, None)]
    assert compare.runs_at("hf-assisted", points[0], args) and not compare.runs_at("hf-assisted", points[1], args)
    assert compare.runs_at("cosine-full", points[1], args) and not compare.runs_at("no-fusion", points[1], args)
    assert compare.runs_at("cosine-plain", points[1], args) and args.rate == []
    full = compare.build_args([])
    assert full.concurrency == [1, 4, 8, 16] and full.rate == [0.5] and compare.build_args(["--rate", ""]).rate == []
    assert compare.n_requests(points[1], 4, args) == 8


def test_full_defaults_poisson_and_system_selection():
    args = compare.build_args(["--rate", "0.5", "--systems", "cosine-full,vanilla-sd", "--concurrency", "1"])
    assert args.systems[0] == "target-only"  # the reference always runs
    points = compare.load_points(args)
    assert points == [("closed", 1, None), ("poisson", None, 0.5)]
    assert compare.runs_at("cosine-full", points[1], args) and not compare.runs_at("merge-fusion", points[0], args)
    assert compare.runs_at("hf-assisted", points[1], compare.build_args(["--rate", "0.5"]))  # FIFO, batch 1
    with pytest.raises(SystemExit):
        compare.build_args(["--systems", "nonsense"])
    high = compare.build_args(["--concurrency", "16", "--rate", ""])
    assert compare.load_points(high) == [("closed", 1, None), ("closed", 16, None)]  # the reference still runs
    assert compare.runs_at("target-only", ("closed", 1, None), high) and not compare.runs_at("cosine-full", ("closed", 1, None), high)


def test_cluster_switches_of_each_system():
    from cosine.common.v1 import common_pb2 as c
    from cosine.router.v1 import router_pb2

    spec = compare.cluster_speculation("lm-code", 4)
    assert set(compare.CLUSTER_SYSTEMS) == set(spec)
    for name, s in spec.items():
        router_pb2.GenerateRequest(prompt=b"x", speculation=s)  # each is a valid SpeculationParams
    assert spec["vanilla-sd"]["drafters"] == ["lm-code"] and spec["vanilla-sd"]["fusion"] == c.FUSION_MODE_SINGLE
    assert not spec["vanilla-sd"]["pipelining"] and not spec["vanilla-sd"]["adaptive_depth"]
    assert spec["no-routing"]["routing"] is False and spec["merge-fusion"]["fusion"] == c.FUSION_MODE_MERGE
    assert spec["no-pipeline"]["pipelining"] is False and spec["fixed-depth"]["adaptive_depth"] is False
    assert spec["cosine-full"] == {"fusion": c.FUSION_MODE_CONFIDENCE, "routing": True, "adaptive_depth": True, "pipelining": True}


def test_table_and_plots(tmp_path):
    recs = [S.RequestRecord(0, "code", 0.0, [0.1, 0.2, 0.3], [1, 2, 3], end_s=0.3, rounds=2, drafted=4, accepted=1)]
    rows = []
    for c in (1, 4):
        rows.append(S.summarise("target-only", recs, {0: [1, 2, 3]}, concurrency=c, wall_s=1.0))
        rows.append(S.summarise("cosine-full", recs, {0: [1, 2, 3]}, concurrency=c, wall_s=0.5, verifier_busy_s=0.4)
                    | {"round_ms": {"rounds": 2, "draft_ms": 1.0, "verify_ms": 2.0, "commit_ms": 0.5, "overhead_ms": 3.0}})
    S.add_ratios(rows)
    doc = S.report(rows, {"workload": [{"domain": "code"}], "max_new_tokens": 3, "duration_s": 1.0, "machine": "m",
                          "accepted_len_by_drafter": {"ngram": {"code": 1.5, "chat": 1.1}}, "notes": ["n"]})
    text = compare.format_table(doc)
    assert "cosine-full" in text and "2.00x" in text and "3/1" not in text and "1/1" in text
    assert "where a round's time goes" in text
    load = plots.plot_load(doc["systems"], tmp_path / "b_load.png")
    acc = plots.plot_accepted(doc["accepted_len_by_drafter"], tmp_path / "b_accepted.png")
    for p in (load, acc):
        assert p is not None and p.stat().st_size > 1000
    assert json.loads(json.dumps(doc))


def test_metrics_parsing():
    body = ('# HELP x\ncosine_worker_busy_seconds_total{service="lm-code"} 1.5\n'
            'cosine_worker_busy_seconds_total{service="ngram"} 0.25\ncosine_worker_busy_seconds_created{service="x"} 9e9\n'
            'cosine_scheduler_draft_ahead_total{outcome="used"} 3.0\n')
    samples = parse_metrics(body)
    assert metric_sum(samples, "cosine_worker_busy_seconds_total") == 1.75
    assert samples['cosine_scheduler_draft_ahead_total{outcome="used"}'] == 3.0


def test_metric_sum_by_labels():
    """The verifier's lookup counter has two labels: the bench sums its sources by outcome (a lookup of the key
    with one label only found nothing once the feature head added the source label)."""
    samples = parse_metrics('cosine_verifier_lookup_tokens_total{outcome="drafted",source="lookup"} 10.0\n'
                            'cosine_verifier_lookup_tokens_total{outcome="accepted",source="lookup"} 4.0\n'
                            'cosine_verifier_lookup_tokens_total{outcome="drafted",source="head"} 7.0\n'
                            'cosine_verifier_lookup_tokens_total{outcome="accepted",source="head"} 2.0\n')
    name = "cosine_verifier_lookup_tokens_total"
    assert metric_sum(samples, name, outcome="drafted") == 17.0
    assert metric_sum(samples, name, outcome="accepted", source="head") == 2.0
    assert metric_sum(samples, name) == 23.0
    assert metric_sum(samples, name, outcome="refused") == 0.0


def test_workload_interleaves_domains():
    by = {d: [BenchPrompt(d, f"{d}{i}", False, "s") for i in range(3)] for d in DOMAINS}
    by["chat"] = by["chat"][:1]
    out = interleave(by, 2)
    assert [p.domain for p in out] == ["code", "docs", "literary", "chat", "code", "docs", "literary"]
    assert BenchPrompt("chat", "hi", True, "s").request_fields(5)["messages"][0]["content"] == "hi"


def test_round_breakdown_between_scrapes():
    before = {k: 0.0 for k in compare.ROUND_METRICS}
    after = dict(before, rounds=10, draft_count=5, draft_sum=0.6, draft_compute_sum=0.5, verify_sum=1.2, verify_compute_sum=1.0,
                 commit_sum=0.01)
    b = compare.round_breakdown(before, after)
    assert b["rounds"] == 10 and b["drafting_rounds"] == 5
    assert b["draft_ms"] == pytest.approx(100.0) and b["verify_ms"] == pytest.approx(100.0)
    assert b["commit_ms"] == pytest.approx(1.0) and b["overhead_ms"] == pytest.approx(30.0)
    assert compare.round_breakdown(before, before) is None


def test_step_breakdown_between_scrapes():
    before = {"batch_sum": 0.0, "batch_count": 0.0, "step_sum": 0.0, "step_count": 0.0, "verifier": 0.0}
    after = {"batch_sum": 40.0, "batch_count": 10.0, "step_sum": 0.5, "step_count": 10.0, "verifier": 0.4}
    b = compare.step_breakdown(before, after, wall_s=0.6)
    assert b["mean_batch"] == pytest.approx(4.0) and b["steps"] == 10
    assert b["step_ms"] == pytest.approx(50.0) and b["verifier_model_ms"] == pytest.approx(40.0)
    assert b["grpc_queue_ms"] == pytest.approx(10.0) and b["between_steps_ms"] == pytest.approx(10.0)
    assert "verifier_step_ms" not in b  # a verifier without the step histogram
    b = compare.step_breakdown({**before, "model_step_sum": 0.0}, {**after, "model_step_sum": 0.3}, wall_s=0.6)
    assert b["verifier_step_ms"] == pytest.approx(30.0)  # the steps alone: the other 10 ms were prefills
    assert compare.step_breakdown(before, before, 1.0) is None
