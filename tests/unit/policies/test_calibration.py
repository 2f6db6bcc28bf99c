"""Online calibration of drafters' probabilities against acceptance (cosine.fusion.calibration): pure logic."""

from __future__ import annotations

import random

import pytest

from cosine.fusion.calibration import Calibrator, CalibrationTable, Reliability
from cosine.fusion.confidence import fuse_step


def test_an_overconfident_drafter_is_mapped_to_its_observed_rate():
    cal = Calibrator(bins=10, prior_weight=8)
    assert cal(0.9) == pytest.approx(0.9)  # nothing seen: as stated
    rng = random.Random(0)
    for _ in range(2000):
        cal.observe(0.92, rng.random() < 0.3)  # states 0.92, is right 30% of the time
    assert cal(0.92) == pytest.approx(0.3, abs=0.04)
    assert cal(0.45) == pytest.approx(0.45)  # a bin it never stated keeps the stated value
    assert cal.raw.ece() == pytest.approx(0.62, abs=0.04)
    # what fusion used moved toward the truth as the map learnt: better calibrated than as stated
    assert cal.mapped.ece() < cal.raw.ece() / 2


def test_counts_are_bounded_and_the_map_follows_a_change():
    rel = Reliability(bins=4, max_count=100)
    for _ in range(1000):
        rel.add(0.9, True)
    assert rel.count[3] <= 100
    cal = Calibrator(bins=4, raw=Reliability(bins=4, max_count=100))
    for _ in range(300):
        cal.observe(0.9, True)
    for _ in range(300):
        cal.observe(0.9, False)  # the workload changed: now it is never right
    assert cal(0.9) < 0.15


def test_observe_round_judges_positions_whose_context_was_committed():
    table = CalibrationTable()
    # own chains: a is right at 0 and 1, wrong at 2 (the target said 9); position 3 is after a mismatch: not judged
    # b is wrong at 0: only position 0 is judged
    table.observe_round({"a": ([5, 7, 1, 2], [0.9, 0.8, 0.7, 0.6]), "b": ([6, 7], [0.5, 0.5])}, committed=[5, 7, 9])
    a, b = table.of("a").raw, table.of("b").raw
    assert a.total == 3 and sum(a.hits) == 2
    assert b.total == 1 and sum(b.hits) == 0
    # confidence fusion: each continued from the fused chain [5, 7, 9]; b's 7 and 9 count, its 6 did not win
    table = CalibrationTable()
    table.observe_round({"b": ([6, 7, 9], [0.4, 0.6, 0.8])}, committed=[5, 7, 9, 4], context=[5, 7, 9])
    b = table.of("b").raw
    assert b.total == 3 and sum(b.hits) == 2
    # nothing known past the committed tokens
    table = CalibrationTable()
    table.observe_round({"a": ([1, 2, 3], [0.9, 0.9, 0.9])}, committed=[1])
    assert table.of("a").raw.total == 1


def test_calibration_changes_which_drafter_wins_a_fusion_step():
    table = CalibrationTable()
    rng = random.Random(1)
    for _ in range(500):
        table.of("lm").observe(0.95, rng.random() < 0.3)  # loud and often wrong
        table.of("suffix").observe(0.55, rng.random() < 0.8)  # modest and usually right
    stated = {"lm": [(11, 0.95)], "suffix": [(22, 0.55)]}
    assert fuse_step(stated).token == 11
    used = {n: [(t, table.map(n, p)) for t, p in c] for n, c in stated.items()}
    assert fuse_step(used).token == 22
    off = CalibrationTable(enabled=False)
    for _ in range(50):
        off.observe_round({"lm": ([3], [0.95])}, committed=[4])
    assert off.map("lm", 0.95) == 0.95  # disabled: as stated (it still measures)
    assert off.of("lm").raw.total == 50
    assert off.of("lm").mapped.ece() == pytest.approx(0.95)  # what fusion used was the stated value
