"""Confidence fusion: picks, tie-breaks, the tree it builds and the budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine.engine.tree import DraftTree, walk
from cosine.fusion.confidence import ConfidenceFusion, fuse_step, fuse_with, merge_only, single_chain
from cosine.fusion.policy import merge_chains


def test_fuse_step_picks_the_more_confident_token():
    s = fuse_step({"a": [(5, 0.6), (6, 0.3)], "b": [(7, 0.8), (5, 0.1)]}, order=["a", "b"])
    assert (s.token, s.prob, s.source, s.support) == (7, 0.8, "b", 1)
    assert s.side == ((5, 0.6), (6, 0.3))


def test_ties_are_broken_deterministically():
    # same top probability: the token more drafters support wins
    s = fuse_step({"a": [(5, 0.5)], "b": [(7, 0.5), (5, 0.2)]}, order=["a", "b"])
    assert s.token == 5
    # full tie: the drafter listed first, whatever the mapping order
    for cands in ({"a": [(9, 0.5)], "b": [(3, 0.5)]}, {"b": [(3, 0.5)], "a": [(9, 0.5)]}):
        assert fuse_step(cands, order=["a", "b"]).token == 9
        assert fuse_step(cands, order=["b", "a"]).token == 3
    # one drafter, equal probabilities: the smaller token
    assert fuse_step({"a": [(9, 0.5), (3, 0.5)]}).token == 3
    assert fuse_step({"a": [], "b": []}) is None
    with pytest.raises(ValueError):
        fuse_step({"a": [(1, 1.5)]})


def _fixed(table):
    """A proposer answering by position from a table of candidate lists."""
    return lambda ctx: table[len(ctx)] if len(ctx) < len(table) else []


def test_main_chain_is_the_fused_chain_and_sides_are_disagreements():
    a = _fixed([[(10, 0.9)], [(11, 0.4)], [(12, 0.9)]])
    b = _fixed([[(10, 0.7)], [(21, 0.8)], [(22, 0.3)]])
    tree, fusion = fuse_with({"a": a, "b": b}, depth=3, budget=10)
    assert fusion.chain == [10, 21, 12]
    assert [tree.tokens[i] for i in tree.main_chain()] == [10, 21, 12]
    assert tree.main_chain() == [0, 1, 2]
    assert tree.tokens[3:] == [11, 22] and tree.parents[3:] == [0, 1]  # side branches beside their step
    tree.validate(100)
    assert walk(tree, [10, 11, 5, 5, 5])[0] == [0, 3]  # the target can take a side branch


def test_drafters_continue_from_the_fused_context():
    seen = []

    def a(ctx):
        seen.append(list(ctx))
        return [(len(ctx) + 100, 0.9)]

    def b(ctx):
        return [(len(ctx) + 200, 0.5)]

    _, fusion = fuse_with({"a": a, "b": b}, depth=3, budget=3)
    assert seen == [[], [100], [100, 101]]
    assert fusion.chain == [100, 101, 102]


def test_budget_keeps_the_most_probable_side_nodes():
    f = ConfidenceFusion(depth=3, budget=5, order=["a", "b", "c"])
    f.step({"a": [(1, 0.5)], "b": [(2, 0.4)], "c": [(3, 0.1)]})
    f.step({"a": [(4, 0.9)], "b": [(5, 0.45)], "c": [(6, 0.3)]})
    f.step({"a": [(7, 0.9)], "b": [(8, 0.05)]})
    assert f.done and f.step({"a": [(9, 1.0)]}) is None
    tree = f.tree()
    assert len(tree) == 5
    assert tree.tokens[:3] == [1, 4, 7]
    # path probabilities: 2 → .4, 3 → .1, 5 → .5·.45 = .225, 6 → .15, 8 → .5·.9·.05
    assert tree.tokens[3:] == [2, 5]
    assert tree.main_chain() == [0, 1, 2]


def test_budget_smaller_than_the_chain_cuts_the_chain():
    tree, fusion = fuse_with({"a": _fixed([[(1, 0.9), (2, 0.1)]] * 5)}, depth=5, budget=2)
    assert tree.tokens == [1, 1] and tree.is_chain()
    assert len(fusion.steps) == 2  # no point drafting what cannot be sent


def test_fusion_stops_when_nobody_proposes():
    tree, fusion = fuse_with({"a": _fixed([[(1, 0.9)]])}, depth=4, budget=8)
    assert fusion.stopped and tree.tokens == [1]
    assert ConfidenceFusion(0, 4).tree() == DraftTree()


def test_width_limits_side_candidates_per_step():
    f = ConfidenceFusion(depth=1, budget=10, width=1)
    f.step({"a": [(1, 0.9), (2, 0.5), (3, 0.4)]})
    assert f.tree().tokens == [1, 2]


def test_merge_only_reuses_merge_chains_and_single_cuts():
    chains = {"a": ([1, 2, 3], [0.9, 0.9, 0.9]), "b": ([1, 5], [0.5, 0.5])}
    assert merge_only(chains, 4) == merge_chains([([1, 2, 3], [0.9] * 3), ([1, 5], [0.5] * 2)], 4)
    assert single_chain([1, 2, 3], [0.5, 0.4, 0.3], 2) == DraftTree.chain([1, 2], [0.5, 0.4])
    assert single_chain([1, 2], [0.5, 0.4], 0) == DraftTree()


cand = st.lists(st.tuples(st.integers(0, 20), st.floats(0, 1)), max_size=4)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(st.dictionaries(st.sampled_from(["a", "b", "c"]), cand, max_size=3), max_size=6),
    depth=st.integers(0, 6),
    budget=st.integers(0, 12),
)
def test_tree_is_valid_within_budget_and_main_chain_is_fused(steps, depth, budget):
    f = ConfidenceFusion(depth, budget, order=["a", "b", "c"])
    for s in steps:
        if f.step(s) is None:
            break
    tree = f.tree()
    tree.validate(21)
    assert len(tree) <= budget
    assert [tree.tokens[i] for i in tree.main_chain()] == f.chain[:budget]
    # every picked token is the top probability of its step
    for st_ in f.steps:
        assert all(p <= st_.prob for _, p in st_.side)
