"""The calibration report of `cosine zoo eval`: reliability bins and expected calibration error."""

import pytest

from cosine.zoo.evaluate import calibration


def test_a_calibrated_drafter_scores_near_zero():
    # in each bin the acceptance rate equals the confidence
    conf, ok = [], []
    for p, n in ((0.15, 20), (0.55, 20), (0.95, 20)):
        hits = round(p * n)
        conf += [p] * n
        ok += [True] * hits + [False] * (n - hits)
    report = calibration(conf, ok)
    assert report["ece"] == pytest.approx(0.0, abs=0.03)
    assert [b["n"] for b in report["bins"]] == [20, 20, 20]


def test_an_overconfident_drafter_shows_its_gap():
    report = calibration([0.9] * 10, [True] * 3 + [False] * 7)
    assert report["ece"] == pytest.approx(0.6)
    assert report["over"] == pytest.approx(0.6)
    assert report["acceptance"] == pytest.approx(0.3)
    assert report["bins"] == [{"lo": 0.9, "hi": 1.0, "n": 10, "confidence": 0.9, "acceptance": 0.3}]


def test_an_underconfident_drafter_and_the_edges():
    report = calibration([0.0, 1.0, 1.0, 0.2], [True, True, True, True], bins=5)
    assert report["over"] < 0  # underconfident
    assert sum(b["n"] for b in report["bins"]) == 4  # 1.0 falls in the last bin, 0.0 in the first
    assert calibration([], [])["ece"] is None
    with pytest.raises(ValueError):
        calibration([0.5], [])


def test_zoo_eval_prints_the_feature_heads_calibration_where_its_card_has_it():
    from cosine.zoo.build import format_table

    row = {"tau": {4: 1.5}, "agreement": 0.4, "speedup": {1: 1.1}, "calibration": {"ece": 0.05, "over": 0.01}}
    report = {"domains": ["code"], "target_step_ms": 9.0, "verify_ratio": {1: 1.08},
              "drafters": [{"drafter": "lm-code", "domain": "code", "cost_ratio": 0.1, "by_domain": {"code": row}}]}
    assert "feature-head" not in format_table(report)
    report["feature_head"] = {"accepted": [0.45, 0.23], "path_probability_after": [0.49, 0.23], "temperatures": [1.59, 1.78]}
    line = next(line for line in format_table(report).splitlines() if line.startswith("feature-head"))
    assert "1: 0.45/0.49, 2: 0.23/0.23" in line and "temperatures 1.59, 1.78" in line
