"""Switches: defaults, validation, parsing, labels."""

import pytest

from cosine.scheduler.switches import Switches


def test_defaults_are_the_full_system():
    s = Switches()
    assert s.full and s.label() == "full"
    assert (s.routing, s.fusion, s.pipelining, s.adaptive_depth) == (True, "confidence", True, True)


def test_parse_and_label():
    s = Switches.parse("routing=off, fusion=merge, pipelining=false, adaptive-depth=0, fixed_depth=3, fixed_drafter=code")
    assert (s.routing, s.fusion, s.pipelining, s.adaptive_depth, s.fixed_depth, s.fixed_drafter) == (
        False, "merge", False, False, 3, "code")
    assert s.label() == "no-routing+merge-only+no-pipelining+fixed-depth-3"
    assert Switches.parse("") == Switches()
    assert Switches.parse("fusion=single").label() == "single-drafter"
    assert Switches.parse("fixed_drafter=none").fixed_drafter is None


def test_validation():
    for bad in ("fusion=tree", "routing=maybe", "fixed_depth=-1", "fixed_depth=x", "speed=fast", "routing"):
        with pytest.raises(ValueError):
            Switches.parse(bad)
    with pytest.raises(ValueError):
        Switches(fixed_drafter="")
    assert Switches().replace(adaptive_depth=False).adaptive_depth is False
