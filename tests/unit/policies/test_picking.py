"""Which replica takes a new request (cosine.common.picking): pure policy over load reports."""

from __future__ import annotations

import pytest

from cosine.common.picking import Candidate, Load, choose, free_slots


def test_fewest_held_requests_wins_counting_those_placed_since_the_report():
    a, b = Candidate(Load(live=3)), Candidate(Load(live=1))
    assert choose([a, b]) == 1
    # b took 3 requests since its report: it now holds 4
    assert choose([a, Candidate(Load(live=1), placed=3)]) == 0


def test_a_full_replica_loses_to_any_with_a_free_slot():
    full = Candidate(Load(live=4, capacity=4))
    busy = Candidate(Load(live=90, capacity=100, queued=50))
    assert choose([full, busy]) == 1
    assert choose([Candidate(Load(live=3, capacity=4), placed=1), busy]) == 1


def test_shares_of_capacity_when_every_replica_reports_one():
    big, small = Candidate(Load(live=8, capacity=64)), Candidate(Load(live=4, capacity=8))
    assert choose([big, small]) == 0  # 1/8 of the big one beats 1/2 of the small one
    # without capacities the counts decide
    assert choose([Candidate(Load(live=8)), Candidate(Load(live=4, capacity=8))]) == 1


def test_queued_work_breaks_ties_of_held_requests():
    assert choose([Candidate(Load(live=2, queued=5)), Candidate(Load(live=2, queued=1))]) == 1


def test_equal_replicas_take_turns():
    equal = [Candidate(Load(live=1)), Candidate(Load(live=1)), Candidate(Load(live=1))]
    assert [choose(equal, turn) for turn in range(6)] == [0, 1, 2, 0, 1, 2]
    # only the tied ones rotate
    mixed = [Candidate(Load(live=5)), Candidate(Load(live=1)), Candidate(Load(live=1))]
    assert {choose(mixed, turn) for turn in range(4)} == {1, 2}


def test_spreading_a_burst_evenly_from_equal_reports():
    placed = [0, 0]
    for turn in range(16):  # no report arrives during the burst: the placed counts alone spread it
        i = choose([Candidate(Load(live=0), placed[0]), Candidate(Load(live=0), placed[1])], turn)
        placed[i] += 1
    assert placed == [8, 8]


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        choose([])


def test_free_slots_count_every_callers_requests():
    # 4 slots each; 3 of other callers' requests on the first, 1 of ours placed on the second since its report
    assert free_slots([Candidate(Load(live=3, capacity=4)), Candidate(Load(live=0, capacity=4), placed=1)]) == 4
    # two schedulers sharing one verifier: the other holds 3, we placed 1 -> full, not 4 - 1 = 3 free
    assert free_slots([Candidate(Load(live=3, capacity=4), placed=1)]) == 0
    # over-full (reports lag) never counts negative against another replica's free slots
    assert free_slots([Candidate(Load(live=5, capacity=4), placed=1), Candidate(Load(capacity=2))]) == 2


def test_free_slots_unknown_without_capacities():
    assert free_slots([]) is None
    assert free_slots([Candidate(Load(live=1, capacity=4)), Candidate(Load(live=0, capacity=0))]) is None
