"""Fusion's health view of its drafters: deadlines from measured step times, skipping, probing, re-admission."""

from __future__ import annotations

from cosine.fusion.health import HealthConfig, HealthView


def view(**kw) -> HealthView:
    return HealthView(["a", "b"], HealthConfig(**{"failures_to_skip": 2, "backoff_s": 1.0, "max_backoff_s": 4.0,
                                                   "floor_s": 0.1, "factor": 4.0, "first_s": 3.0, **kw}))


def test_deadline_follows_the_measured_step_time_with_a_floor_and_a_first_call_allowance():
    h = view()
    assert h.deadline("a", 4) == 3.0  # nothing measured yet: the first-call allowance
    h.success("a", 0.2, 4)  # 50 ms per position
    assert abs(h.deadline("a", 4) - 4.0 * 0.05 * 4) < 1e-9
    assert abs(h.deadline("a", 8) - 4.0 * 0.05 * 8) < 1e-9
    assert h.deadline("a", 4, first=True) == 3.0
    for _ in range(30):  # a moving average: it follows the drafter getting faster
        h.success("a", 0.004, 4)
    h.success("a", None)  # a prefill is not a step-time measure
    assert h.deadline("a", 1) == 0.1  # the floor
    assert h.deadline("b", 1) == 3.0  # each drafter its own


def test_repeated_failures_skip_a_drafter_until_a_probe_passes():
    h = view()
    assert h.failure("a", now=0.0) is False and h.usable("a")
    h.success("a", 0.01)  # a success in between resets the count
    assert h.failure("a", now=0.0) is False
    assert h.failure("a", now=0.0) is True and not h.usable("a") and h.usable("b")
    assert h.skipped() == ["a"]
    assert h.probes_due(0.5) == []  # backoff not over
    assert h.probes_due(1.0) == ["a"] and h.probes_due(1.0) == []  # one probe at a time
    h.probe_result("a", False, now=1.0)  # still dead: the backoff doubles
    assert h.probes_due(2.5) == [] and h.probes_due(3.0) == ["a"]
    h.probe_result("a", False, now=3.0)
    h.probes_due(7.0)
    h.probe_result("a", False, now=7.0)
    assert h.probes_due(10.9) == [] and h.probes_due(11.0) == ["a"]  # capped at max_backoff_s
    h.probe_result("a", True, now=11.0)
    assert h.usable("a")
    assert h.failure("a", now=12.0) is False  # the count starts again


def test_measured_speed_survives_a_skip():
    h = view()
    h.success("a", 0.4, 4)
    h.failure("a", 0.0)
    h.failure("a", 0.0)
    h.probes_due(1.0)
    h.probe_result("a", True, 1.0)
    assert abs(h.deadline("a", 1) - 0.4) < 1e-9
