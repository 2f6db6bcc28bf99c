"""cosine bench faults: the rows it prints from the outcomes of a scenario."""

from __future__ import annotations

from cosine.bench.faults import Outcome, row, table


def test_a_row_counts_completed_identical_refusals_and_added_latency():
    reference = {0: [1, 2, 3], 1: [4, 5]}
    outcomes = [Outcome(0, "OK", [1, 2, 3], 2.0), Outcome(1, "OK", [4, 9], 4.0),
                Outcome(0, "RESOURCE_EXHAUSTED", [], 0.03), Outcome(1, "RESOURCE_EXHAUSTED", [], 0.07),
                Outcome(1, "UNAVAILABLE", [4], 1.0)]
    r = row("overload", outcomes, reference, base_median=1.5)
    assert (r.requests, r.completed, r.identical) == (5, 2, 1)
    assert r.errors == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert abs(r.slowest_refusal_ms - 70) < 1e-9
    assert abs(r.added_latency_s - 1.5) < 1e-9  # median of 2.0 and 4.0, minus 1.5
    text = table([r])
    assert "overload" in text and "/70 ms" in text and "UNAVAILABLE 1" in text


def test_a_failover_row_gives_the_streams_hit_and_the_p99_added_latency_per_prompt():
    reference = {0: [1, 2], 1: [3, 4]}
    outcomes = [Outcome(0, "OK", [1, 2], 2.5, max_gap_s=1.6), Outcome(1, "OK", [3, 4], 1.1, max_gap_s=0.2)]
    r = row("scheduler SIGKILLed", outcomes, reference, base_median=1.0, base_gaps={0: 0.1, 1: 0.1}, hit=1)
    assert r.identical == 2 and r.hit == 1
    assert abs(r.added_p99_s - 1.5) < 1e-9  # each stream's longest pause against its own prompt's fault-free one
    assert "+1.50 s" in table([r])
