"""The planner's simulator: its clock, its link arithmetic, a tiny deployment with a known answer, and that the
policy it runs is the scheduler service's own."""

from __future__ import annotations

import asyncio

import pytest

from cosine.plan import simloop
from cosine.plan.costs import Costs, Link
from cosine.plan.sim import Deployment, SimLink, SimPrompt, SimScheduler, simulate
from cosine.plan.traces import AcceptanceTrace, from_records, rounds_of
from cosine.scheduler.service import SchedulerServicer
from cosine.scheduler.steploop import StepLoop


def test_virtual_clock_orders_events_by_due_time_and_the_same_way_every_run():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []

        async def at(name, delay):
            await asyncio.sleep(delay)
            seen.append((name, loop.time()))

        await asyncio.gather(at("late", 3600.0), at("a", 2.0), at("b", 2.0), at("first", 0.5))
        return seen

    seen = simloop.run(main())
    assert [t for _, t in seen] == [0.5, 2.0, 2.0, 3600.0]
    assert seen[0][0] == "first" and seen[-1][0] == "late" and {seen[1][0], seen[2][0]} == {"a", "b"}
    assert simloop.run(main()) == seen  # ties are broken deterministically


def test_virtual_clock_runs_an_hour_in_no_time_and_stops_on_a_stall():
    import time

    started = time.perf_counter()
    assert simloop.run(asyncio.sleep(3600, result="done")) == "done"
    assert time.perf_counter() - started < 1.0

    async def waits_forever():
        await asyncio.Event().wait()

    with pytest.raises(simloop.SimulationStalled):
        simloop.run(waits_forever())


def test_link_cost_is_latency_plus_size_over_bandwidth():
    link = Link(latency_s=0.002, bandwidth_bps=100e6)  # 100 Mbps
    assert link.transfer_s(1250) == pytest.approx(0.002 + 1250 * 8 / 100e6)
    assert Link(0.001, 0).transfer_s(10**9) == pytest.approx(0.001)  # unlimited bandwidth


def test_messages_share_a_links_bandwidth_in_turn_and_its_latency_at_once():
    async def main():
        link = SimLink("l", Link(latency_s=0.010, bandwidth_bps=8e6))  # 1 MB/s: 1000 bytes take 1 ms
        loop = asyncio.get_running_loop()
        done = []

        async def send():
            await link.send(1000)
            done.append(loop.time())

        await asyncio.gather(send(), send())
        return done, link.bytes

    done, sent = simloop.run(main())
    assert done == [pytest.approx(0.011), pytest.approx(0.012)]  # the second waits for the wire, not the latency
    assert sent == 2000


def _costs(verify_s=0.010, commit_s=0.002, draft_step_s=0.001) -> Costs:
    return Costs(verify=[verify_s, 0.0, 0.0, 0.0], drafters={"d": [0.0, draft_step_s, 0.0, 0.0]}, commit_s=commit_s,
                 links={"internal": Link(0.0)})


def test_plain_decoding_of_one_request_has_the_known_answer():
    # one token per round trip (decode_steps 1); a step is one verification (10 ms) and one commit (2 ms): every
    # token 12 ms after the last
    row = simulate(Deployment(drafters={"d": 1}, candidates=["d"], speculation={"disabled": True},
                              scheduler={"decode_steps": 1}), _costs(),
                   AcceptanceTrace(8, {}), [SimPrompt("code", 16, 20)], concurrency=1)
    assert row["tokens_per_s"] == pytest.approx(20 / (20 * 0.012))
    assert row["ttft_ms_p50"] == pytest.approx(12.0)
    assert row["tpot_ms_p50"] == pytest.approx(12.0)
    assert row["steps"] == [1] * 20


def test_plain_decoding_in_decode_runs_has_the_known_answer():
    # the service's default: the opening step gives the first token (12 ms); then runs of 4 steps (4 x 10 ms) and
    # one commit (2 ms), the last run 3 steps: 12 + 4 x 42 + 32 = 212 ms for 20 tokens
    row = simulate(Deployment(drafters={"d": 1}, candidates=["d"], speculation={"disabled": True}), _costs(),
                   AcceptanceTrace(8, {}), [SimPrompt("code", 16, 20)], concurrency=1)
    assert row["tokens_per_s"] == pytest.approx(20 / 0.212)
    assert row["ttft_ms_p50"] == pytest.approx(12.0)
    assert row["steps"] == [1] * 6  # six round trips
    assert row["mean_accepted_len"] == pytest.approx(1.0)  # tokens per verification step: plain decoding


def test_fixed_depth_with_every_draft_accepted_commits_depth_plus_one_per_round():
    trace = AcceptanceTrace(8, {"d": {"code": [8]}})  # always at least 8 accepted
    spec = {"drafters": ["d"], "max_depth": 4, "fusion": 3, "routing": False, "adaptive_depth": False, "pipelining": False}
    row = simulate(Deployment(drafters={"d": 1}, candidates=["d"], speculation=spec), _costs(), trace,
                   [SimPrompt("code", 16, 20)], concurrency=1)
    # 4 rounds of 5 tokens; a round = 4 draft steps (4 ms) + verification (10 ms) + commit (2 ms)
    assert row["mean_accepted_len"] == pytest.approx(5.0)
    assert row["decisions"] == [("sim-0", 4, ("d",))] * 4
    assert row["ttft_ms_p50"] == pytest.approx(16.0)
    assert row["tpot_ms_p50"] == pytest.approx(16.0 * 3 / 19)  # (last - first) / (n - 1): 3 more rounds after the first


def test_a_drafter_that_is_never_right_is_truncated_to_what_the_trace_says():
    trace = AcceptanceTrace(8, {"d": {"code": [1, 0]}})
    spec = {"drafters": ["d"], "max_depth": 3, "fusion": 3, "routing": False, "adaptive_depth": False, "pipelining": False}
    row = simulate(Deployment(drafters={"d": 1}, candidates=["d"], speculation=spec), _costs(), trace,
                   [SimPrompt("code", 16, 12)], concurrency=1)
    assert row["mean_accepted_len"] == pytest.approx(1.5, abs=0.3)  # rounds commit 2, 1, 2, 1, ...


def test_concurrent_plain_requests_share_verification_steps():
    row = simulate(Deployment(drafters={"d": 1}, candidates=["d"], speculation={"disabled": True},
                              scheduler={"decode_steps": 1}), _costs(),
                   AcceptanceTrace(8, {}), [SimPrompt("code", 16, 10)] * 4, concurrency=4)
    assert max(row["steps"]) == 4  # the step loop's batch choice puts all four in one step
    assert sum(row["steps"]) == 40


def test_the_simulated_scheduler_runs_the_services_policy_code():
    # only the I/O ports are the simulator's; every policy method is the service's own
    for name in ("plan", "_round_plan", "plan_ahead", "learn", "observe_ahead", "_learn", "_control", "_prior"):
        assert getattr(SimScheduler, name) is getattr(SchedulerServicer, name), name
    assert issubclass(SimScheduler, SchedulerServicer)

    async def main():
        from cosine.plan.sim import Simulation

        sim = Simulation(Deployment(drafters={"d": 1}), _costs(), AcceptanceTrace(8, {}))
        return type(sim.schedulers[0].loop), sim.schedulers[0].loop.clock.now()

    loop_type, now = simloop.run(main())
    assert loop_type is StepLoop and now == 0.0


def test_a_trace_is_the_rounds_of_the_streamed_chunks():
    from cosine.bench.stats import RequestRecord

    # chunks of 3, 1, 5 and a last one cut by the token limit: accepted 2, 0, 4
    times = [0.1] * 3 + [0.2] + [0.3] * 5 + [0.4] * 2
    assert rounds_of(times) == [3, 1, 5, 2]
    rec = RequestRecord(prompt_index=0, domain="code", arrival_s=0.0, token_times_s=times, token_ids=list(range(11)))
    trace = from_records({"d": [rec]}, 8, "test")
    assert trace.rounds == {"d": {"code": [2, 0, 4]}}
    assert trace.accepted("d", "code", 2, depth=3) == 3  # truncated to the depth asked for
    assert trace.accepted("d", "docs", 0, depth=8) == 2  # an unrecorded domain: all of the drafter's rounds


def test_the_calibration_fit_keeps_every_cost_nonnegative():
    import numpy as np

    from cosine.plan.validate import nonnegative_lstsq

    X = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_lstsq(X, np.array([3.0, 5.0, 7.0])) == pytest.approx([1.0, 2.0])
    # falling times would need a negative slope: the slope is dropped, the intercept is the mean
    assert nonnegative_lstsq(X, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0])


def test_jobs_on_a_shared_cpu_slow_each_other_by_processor_sharing():
    from cosine.plan.sim import SharedCPU

    async def main():
        cpu = SharedCPU(cores=2)
        loop = asyncio.get_running_loop()
        done = {}

        async def job(name, seconds, threads, start=0.0):
            await asyncio.sleep(start)
            await cpu.run(seconds, threads)
            done[name] = loop.time()

        # 3 threads on 2 cores: both at 2/3 speed until b is done at 0.75 s; a then alone, 0.5 s of work left
        await asyncio.gather(job("a", 1.0, 2), job("b", 0.5, 1))
        first = dict(done)
        done.clear()
        t0 = loop.time()
        await asyncio.gather(job("c", 1.0, 1), job("d", 1.0, 1))  # 2 threads on 2 cores: no slowdown
        return first, {k: v - t0 for k, v in done.items()}

    first, second = simloop.run(main())
    assert first == {"b": pytest.approx(0.75), "a": pytest.approx(1.25)}
    assert second == {"c": pytest.approx(1.0), "d": pytest.approx(1.0)}


def test_two_schedulers_spread_requests_over_two_verifiers():
    from cosine.plan.sim import Simulation

    async def main():
        sim = Simulation(Deployment(schedulers=2, verifiers=2, speculation={"disabled": True}, scheduler={"decode_steps": 1}),
                         _costs(), AcceptanceTrace(8, {}))
        records, wall = await sim.closed_loop([SimPrompt("code", 16, 10)] * 4, [0, 1, 2, 3], 4)
        await sim.close()
        return records, wall, [d.jobs for d in sim.verifier_devices]

    records, wall, jobs = simloop.run(main())
    assert all(len(r.token_ids) == 10 for r in records)
    assert jobs[0] > 0 and jobs[1] > 0  # the router's round robin: each scheduler on its own verifier
    assert wall == pytest.approx(10 * 0.012)  # two requests per verifier step, all four done after ten steps


def test_cosine_plan_help_explains_its_modes(capsys):
    from cosine.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--validate" in out and "--sweep" in out and "measured_tokens_per_s" in out


def test_the_paper_scenario_loads_with_its_roofline_costs_and_mapped_trace():
    from cosine.plan import scenario
    from cosine.plan.costs import from_profile, load_profiles

    path = scenario.HERE / "scenarios" / "paper.json"
    doc = scenario.load(path)
    costs = from_profile(doc)
    a100 = load_profiles()["devices"]["A100-80GB-SXM"]
    eff = load_profiles()["efficiency"]
    # 13B bf16 weights read once per step from 4 A100s at the stated efficiency, the per-pass overhead, and the
    # FLOPs of the one position verified (2 per parameter)
    expected = (13e9 * 2 / (4 * a100["memory_bandwidth_gb_s"] * 1e9 * eff["memory"]) + eff["forward_overhead_ms"] / 1000
                + 2 * 13e9 / (4 * a100["bf16_dense_tflops"] * 1e12 * eff["compute"]))
    assert costs.verify_s(1, 256, 0) == pytest.approx(expected, rel=1e-3)
    assert costs.link("drafter").transfer_s(1250) == pytest.approx(0.002 + 1250 * 8 / 100e6)
    trace = scenario.trace_of(doc, path.parent)
    assert set(doc["deployment"]["drafters"]) <= set(trace.rounds)
    cos, van = scenario.cosine_deployment(doc), scenario.baseline_deployment(doc)
    assert sum(cos.drafters.values()) == 16 and van.colocated
    assert scenario.hourly(doc, cos) == pytest.approx(20.49 + 16 * 0.805)
