"""The speculation gate: windows with and without drafting, compared per load (pure code, virtual time)."""

import pytest

from cosine.scheduler.speculation import SpeculationGate, load_bucket


def run(gate: SpeculationGate, rate, live: int, seconds: float, tick: float = 0.05) -> list[bool]:
    """Drive the gate for `seconds` more of virtual time at `live` requests; `rate(speculating)` tokens/s.
    Returns the mode of every tick."""
    t = getattr(gate, "_test_clock", 0.0)
    end = t + seconds
    modes = []
    while t < end:
        on = gate.speculate(t, live)
        modes.append(on)
        gate.observe(round(rate(on) * tick))
        t += tick
    gate._test_clock = t
    return modes


def test_load_buckets():
    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_turns_speculation_off_where_plain_decoding_is_faster():
    gate = SpeculationGate(window_s=1.0, explore_every=8)
    modes = run(gate, lambda on: 80 if on else 120, live=8, seconds=80)
    late = modes[len(modes) // 4:]  # after the first measurements
    share = sum(late) / len(late)
    assert 0 < share <= 1 / 8 + 0.02  # only the exploring windows draft
    assert gate.gain(8) == pytest.approx(80 / 120, rel=0.05)


def test_keeps_speculation_where_it_pays():
    gate = SpeculationGate(window_s=1.0, explore_every=8)
    modes = run(gate, lambda on: 60 if on else 40, live=1, seconds=80)
    late = modes[len(modes) // 4:]
    assert sum(late) / len(late) >= 1 - 1 / 8 - 0.02
    assert gate.gain(1) == pytest.approx(1.5, rel=0.05)


def test_loads_are_judged_apart():
    gate = SpeculationGate(window_s=1.0)
    run(gate, lambda on: 60 if on else 40, live=1, seconds=30)  # alone, speculation pays
    run(gate, lambda on: 80 if on else 120, live=16, seconds=30)  # under load it does not
    assert gate.gain(1) > 1 > gate.gain(16)
    assert gate.choose(1) is not gate.exploring(1)
    assert gate.choose(16) is gate.exploring(16)


def test_explores_less_while_the_judgement_holds():
    gate = SpeculationGate(window_s=1.0, explore_every=8, max_explore_every=32)
    modes = run(gate, lambda on: 80 if on else 120, live=8, seconds=300, tick=0.5)
    windows = modes[::2]  # one mode per window
    explored = [i for i, on in enumerate(windows) if on][1:]  # after the first measurement of drafting
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[:3] == [8, 16, 32] and set(gaps[3:]) == {32}
    assert sum(windows[100:]) / len(windows[100:]) <= 1 / 32 + 0.01  # was 1 in 8 for good
    modes = run(gate, lambda on: 200 if on else 120, live=8, seconds=100, tick=0.5)  # the drafts got good
    windows = modes[::2]
    assert sum(windows[-40:]) / 40 >= 1 - 1 / 8 - 0.01  # noticed within 32 windows; now drafting, exploring plain again


def test_follows_a_change_in_the_workload():
    gate = SpeculationGate(window_s=1.0, explore_every=4, smoothing=0.5)
    run(gate, lambda on: 50 if on else 100, live=4, seconds=40)
    assert gate.gain(4) < 1
    modes = run(gate, lambda on: 200 if on else 100, live=4, seconds=60)  # the drafts got good
    assert gate.gain(4) > 1
    assert sum(modes[-200:]) / 200 >= 0.6  # was ~1/4 (exploring only); now drafting but in exploring windows


def test_a_window_whose_load_changed_or_that_idled_teaches_nothing():
    gate = SpeculationGate(window_s=1.0)
    gate.speculate(0.0, 4)
    gate.observe(50)
    gate.speculate(0.5, 16)  # the load left its bucket mid-window
    gate.speculate(1.0, 16)
    assert gate.rates == {}
    gate.observe(0)
    gate.speculate(2.0, 16)  # a window without tokens
    assert gate.rates == {}
    gate.speculate(2.5, 0)
    gate.speculate(3.5, 0)  # idle
    assert gate.rates == {}


def test_a_window_left_open_while_no_adaptive_request_asked_teaches_nothing():
    """Only adaptive requests ask the gate; tokens committed while none did (requests with speculation off
    or fixed) are not the window's mode at work."""
    gate = SpeculationGate(window_s=1.0)
    gate.speculate(0.0, 1)
    gate.observe(30)
    gate.speculate(0.9, 1)
    gate.observe(2000)  # 20 s of other requests' tokens
    gate.speculate(20.0, 1)
    assert gate.rates == {}
    gate.observe(30)
    gate.speculate(21.0, 1)
    assert list(gate.rates) == [1] and list(gate.rates[1].values()) == [pytest.approx(30.0)]


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        SpeculationGate(window_s=0)
    with pytest.raises(ValueError):
        SpeculationGate(explore_every=1)


def test_a_new_load_starts_from_the_nearest_judged_one():
    gate = SpeculationGate(window_s=1.0, explore_every=8)
    run(gate, lambda on: 80 if on else 120, live=8, seconds=20)
    assert gate.choose(16) is False  # not measured at 16 yet: as at 8
    modes = run(gate, lambda on: 80 if on else 120, live=16, seconds=40)
    assert sum(modes) / len(modes) <= 0.05  # no window-by-window trial of both modes first
    assert 16 in gate.rates and True in gate.rates[16]  # the exploring windows measured drafting there too


def explorations(gate: SpeculationGate, rate, live: int, seconds: float) -> list[int]:
    """The windows (one per second) in which the gate ran the mode it judged worse."""
    modes = run(gate, rate, live=live, seconds=seconds, tick=0.5)[::2]
    worse = not gate.pays(live)
    return [i for i, on in enumerate(modes) if on == worse]


def test_a_judgement_that_follows_from_a_lower_load_is_explored_later():
    """Speculation lost at 4 requests: at 16 it loses too (drafting is worth less as load grows), so the first
    window that drafts there comes after max_explore_every windows, not explore_every."""
    lost = lambda on: 80 if on else 120  # noqa: E731
    gate = SpeculationGate(window_s=1.0, explore_every=8, max_explore_every=32)
    run(gate, lost, live=4, seconds=20, tick=0.5)
    assert gate.confirmed(16, False) and not gate.confirmed(2, False)
    assert explorations(gate, lost, live=16, seconds=40) == [31]
    # at a lower load than the one judged, losing is not implied: explored at the usual pace
    assert explorations(gate, lost, live=2, seconds=20)[0] == 7


def test_a_judgement_that_pays_is_confirmed_only_by_a_higher_load():
    paid = lambda on: 60 if on else 40  # noqa: E731
    gate = SpeculationGate(window_s=1.0, explore_every=8, max_explore_every=32)
    run(gate, paid, live=8, seconds=20, tick=0.5)
    assert gate.confirmed(2, True) and not gate.confirmed(16, True)
    assert explorations(gate, paid, live=2, seconds=40) == [31]  # plain decoding tried late at the lighter load
    assert explorations(gate, paid, live=16, seconds=20)[0] == 7
