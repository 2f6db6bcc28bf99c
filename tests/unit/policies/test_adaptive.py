"""The measurements adaptive speculation control learns from, and how the scheduler resolves switches and drafters."""

from __future__ import annotations

import pytest

from cosine.common.v1 import common_pb2
from cosine.fusion.service import FusionMetrics
from cosine.scheduler.adaptive import CostModel, DepthChooser, LinearFit, LoadMeter
from cosine.scheduler.service import SchedulerConfig, SchedulerMetrics, SchedulerServicer, request_switches, tree_depth
from cosine.scheduler.speculation import RequestSpeculation, SpeculationCosts, best_depth
from cosine.scheduler.switches import Switches
from cosine.scheduler.v1 import scheduler_pb2


def test_linear_fit_recovers_a_line_and_knows_when_it_cannot():
    fit = LinearFit(decay=1.0)
    for x in (1, 2, 3, 4, 6):
        fit.add(x, 0.5 + 2.0 * x)
    assert fit.slope() == pytest.approx(2.0)
    flat = LinearFit()
    for _ in range(5):
        flat.add(4, 1.0)
    assert flat.slope() is None


def test_cost_model_fits_draft_steps_overhead_and_verification():
    model = CostModel(decay=1.0)
    assert model.costs() is None  # nothing measured yet
    for d in (1, 2, 4, 8, 3):
        model.observe_draft(d, 0.002 + 0.001 * d)  # 2 ms a round, 1 ms a step
        model.observe_verify(d, 0.010 + 0.0005 * d)
        model.observe_overhead(0.003)
    c = model.costs()
    assert c.draft_step_s == pytest.approx(0.001) and c.draft_overhead_s == pytest.approx(0.002)
    assert c.verify_per_token_s == pytest.approx(0.0005)
    assert c.verify_s == pytest.approx(0.010 + 0.003)  # the round's other costs count as verification's intercept
    assert c.round_s(0) == pytest.approx(0.013) and c.round_s(2) == pytest.approx(0.013 + 0.001 + 0.002 + 0.002)


def test_cost_model_fits_each_drafting_configuration_apart():
    model = CostModel(decay=1.0)
    for d in (1, 2, 3):
        model.observe_draft(d, 0.004 * d, key=("confidence", 2))  # a message exchange per step
        model.observe_draft(d, 0.004 + 0.001 * d, key=("merge", 2))  # one exchange per round
        model.observe_verify(d, 0.010)
    assert model.costs(("confidence", 2)).draft_step_s == pytest.approx(0.004)
    assert model.costs(("merge", 2)).draft_step_s == pytest.approx(0.001)
    assert model.costs(("single", 1)) is None  # never measured: the caller explores at its cap


def test_cost_model_with_one_depth_puts_drafting_on_the_steps():
    model = CostModel()
    for _ in range(4):
        model.observe_draft(4, 0.008)
        model.observe_verify(4, 0.010)
    c = model.costs()
    assert c.draft_step_s == pytest.approx(0.002) and c.draft_overhead_s == 0
    assert c.verify_s == pytest.approx(0.010) and c.verify_per_token_s == 0


def test_draft_overhead_makes_plain_decoding_win_when_acceptance_is_low():
    cheap = SpeculationCosts(draft_step_s=0.001, verify_s=0.010)
    costly = SpeculationCosts(draft_step_s=0.001, verify_s=0.010, draft_overhead_s=0.010)
    assert best_depth(0.3, cheap, 8) > 0
    assert best_depth(0.3, costly, 8) == 0
    assert best_depth(0.95, costly, 8) > 0  # a drafter the target agrees with still pays for the round trip


def test_load_meter_reads_idle_fraction_and_queue():
    meter = LoadMeter(now=0.0)
    meter.enter(1.0)
    meter.enter(1.5)
    meter.leave(2.0)
    meter.leave(3.0)  # busy 1.0 .. 3.0
    assert meter.read(4.0) == (pytest.approx(0.5), 0)
    meter.enter(5.0)
    assert meter.read(6.0) == (pytest.approx(0.5), 1)  # busy 5 .. 6 of the window 4 .. 6, one waiting now
    meter.leave(7.0)
    assert meter.read(8.0) == (pytest.approx(0.5), 0)  # the busy time 6 .. 7 is counted in its own window
    with pytest.raises(ValueError):
        meter.leave(9.0)


def test_depth_chooser_probes_after_plain_rounds_and_recovers():
    costs = SpeculationCosts(draft_step_s=0.004, verify_s=0.010, draft_overhead_s=0.005)
    chooser = DepthChooser(RequestSpeculation(max_depth=8, prior_alpha=0.05), probe_every=4, probe_depth=2)
    depths = [chooser.choose(costs, cap=6) for _ in range(4)]
    assert depths == [0, 0, 0, 2]  # speculation does not pay: plain, with a probe after 4 plain rounds
    for _ in range(6):  # the probes find the drafter is now always right
        chooser.speculation.observe(2, 2)
    assert chooser.choose(costs, cap=6) > 2
    assert DepthChooser(RequestSpeculation(max_depth=8)).choose(None, cap=3) == 3  # no costs yet: the cap


def test_depth_chooser_backs_off_probes_that_do_not_pay_and_resets_when_drafting_pays():
    costs = SpeculationCosts(draft_step_s=0.004, verify_s=0.010, draft_overhead_s=0.005)
    chooser = DepthChooser(RequestSpeculation(max_depth=8, prior_alpha=0.05), probe_every=4, probe_depth=2,
                           max_probe_every=16)
    depths = [chooser.choose(costs, cap=6) for _ in range(4 + 8 + 16 + 16 + 16)]
    probes = [i + 1 for i, d in enumerate(depths) if d]
    assert set(depths) == {0, 2}
    assert probes == [4, 12, 28, 44, 60]  # waits of 4, 8, 16, then 16 (the most) plain rounds
    for _ in range(6):  # drafting pays again: the next round drafts on its own merit, and the waits restart at 4
        chooser.speculation.observe(2, 2)
    assert chooser.choose(costs, cap=6) > 2
    for _ in range(40):
        chooser.speculation.observe(4, 0)
    depths = [chooser.choose(costs, cap=6) for _ in range(12)]
    assert [i + 1 for i, d in enumerate(depths) if d] == [4, 12]
    # a cap of 0 (the global controller: no speculation at this load) stops probes altogether
    assert [chooser.choose(costs, cap=0) for _ in range(40)] == [0] * 40


def test_a_decode_runs_plain_tokens_count_toward_the_next_probe_as_rounds():
    costs = SpeculationCosts(draft_step_s=0.004, verify_s=0.010, draft_overhead_s=0.005)
    chooser = DepthChooser(RequestSpeculation(max_depth=8, prior_alpha=0.05), probe_every=8, probe_depth=2)
    depths = []
    for _ in range(3):  # rounds of 4 plain tokens each (one chosen, three more decoded in the run)
        depths.append(chooser.choose(costs, cap=6))
        if depths[-1] == 0:
            chooser.count_plain(3)
    assert depths == [0, 0, 2]  # 8 plain tokens in two rounds: the third probes, as the ninth single round would


def test_tree_depth():
    assert tree_depth([]) == 0
    assert tree_depth([-1, 0, 1, 2]) == 4
    assert tree_depth([-1, 0, 1, -1, 0, 4]) == 3


def test_request_switches_override_only_what_the_request_sets():
    server = Switches.parse("routing=off,fusion=merge")
    assert request_switches(server, common_pb2.SpeculationParams()) == server
    spec = common_pb2.SpeculationParams(fusion=common_pb2.FUSION_MODE_SINGLE, adaptive_depth=False)
    assert request_switches(server, spec) == server.replace(fusion="single", adaptive_depth=False)
    assert request_switches(server, common_pb2.SpeculationParams(routing=True)).routing is True


def test_judge_scores_confidence_fusion_against_the_fused_context():
    from prometheus_client import CollectorRegistry

    metrics = FusionMetrics(registry=CollectorRegistry())
    # the target took 5 7 9 (then its own 4); drafter b was wrong at 0 but, continuing from the fused 5, right at 1 and 2
    metrics.judge({"a": [5, 7, 1], "b": [6, 7, 9]}, [5, 7, 9, 4], context=[5, 7, 9])
    assert metrics.accepted.labels("a")._value.get() == 2 and metrics.accepted.labels("b")._value.get() == 2
    metrics.judge({"c": [6, 7, 9]}, [5, 7, 9, 4])  # drafted on its own: its context was its own 6, rejected
    assert metrics.accepted.labels("c")._value.get() == 0


def _scheduler(switches: Switches, max_depth: int = 16):
    from prometheus_client import CollectorRegistry

    return SchedulerServicer(None, None, None, SchedulerConfig(4, max_depth, switches=switches), SchedulerMetrics(CollectorRegistry()))


def _submit(**speculation) -> scheduler_pb2.SubmitRequest:
    candidates = speculation.pop("candidates", [])
    return scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1], max_new_tokens=4, candidate_drafters=candidates,
                                       speculation=common_pb2.SpeculationParams(**speculation))


def test_plan_resolves_drafters_from_the_switches():
    full = _scheduler(Switches())
    plan = full.plan(_submit(drafters=["ngram"], candidates=["ngram", "tiny", "code"]))
    assert plan.pool == ["ngram", "tiny", "code"] and plan.router is not None and plan.depth is not None
    assert full._round_plan(plan, room=10)[1] == ["ngram", "tiny"]  # top-2, ties in the router's order
    off = full.plan(_submit(drafters=["ngram"], candidates=["ngram", "tiny"], routing=False))
    assert off.pool == off.fixed == ["ngram"] and off.router is None
    named = full.plan(_submit(drafters=["tiny", "ngram"]))  # the client named them: exactly those, every round
    assert named.router is None and full._round_plan(named, room=10)[1] == ["tiny", "ngram"]
    single = full.plan(_submit(drafters=["tiny", "ngram"], fusion=common_pb2.FUSION_MODE_SINGLE))
    assert full._round_plan(single, room=10)[1] == ["tiny"]
    assert full.plan(_submit(disabled=True, candidates=["ngram"])).speculate is False
    fixed = _scheduler(Switches.parse("routing=off,fixed_drafter=tiny,adaptive_depth=off,fixed_depth=3"))
    plan = fixed.plan(_submit(drafters=["ngram"], candidates=["ngram", "tiny"]))
    assert plan.pool == ["tiny"] and plan.depth is None
    assert fixed._round_plan(plan, room=10) == (3, ["tiny"], 0) and fixed._round_plan(plan, room=2)[0] == 2
    own = fixed.plan(_submit(drafters=["ngram"], max_depth=5))
    assert fixed._round_plan(own, room=10)[0] == 5  # the request's max_depth is its fixed depth


def test_scheduler_settings_parse_switches(monkeypatch):
    from cosine.scheduler.__main__ import SchedulerSettings

    monkeypatch.setenv("COSINE_SCHEDULER_SWITCHES", "routing=off,fusion=merge")
    s = SchedulerSettings(default_depth=5)
    assert s.parsed_switches() == Switches(routing=False, fusion="merge", fixed_depth=5)  # fixed_depth follows default_depth
    monkeypatch.setenv("COSINE_SCHEDULER_SWITCHES", "fixed_depth=2,adaptive_depth=off")
    assert SchedulerSettings(default_depth=5).parsed_switches().fixed_depth == 2
    monkeypatch.setenv("COSINE_SCHEDULER_SWITCHES", "fusion=fancy")
    with pytest.raises(ValueError):
        SchedulerSettings()
