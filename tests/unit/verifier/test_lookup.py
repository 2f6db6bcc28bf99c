"""The verifier's lookup (`cosine.verifier.lookup`) and its place in the batcher's plain steps: what it proposes,
that it never changes a token (a fake target that writes a fixed text; the real tiny target in
tests/unit/engine/test_lookup_lossless.py), and that it saves steps where the text repeats itself."""

from __future__ import annotations

import asyncio
import random

import pytest

from cosine.common.streams import ModelWorker
from cosine.engine.hf_target import VerifyOutcome
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree
from cosine.verifier.batcher import BatchStep, VerifyBatcher
from cosine.verifier.lookup import RunLookup

pytestmark = pytest.mark.unit


def test_a_repeated_passage_is_proposed_as_a_chain_whose_path_probability_stays_above_the_floor():
    lookup = RunLookup()
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    committed = [1, 2] + text + [3, 4] + text[:4]  # the passage again, its first half written so far
    tree = lookup.chain("r", committed, depth=8)
    assert len(tree) > 0 and tree.tokens == (text + [3, 4])[4:4 + len(tree)]  # what followed it last time
    assert tree.parents == list(range(-1, len(tree) - 1))  # a chain
    for batch in (1, 4, 16):
        path = 1.0
        for p in lookup.chain("r", committed, depth=8, batch=batch).probs:
            path *= p
            assert path >= lookup.min_path(batch)
    assert len(lookup.chain("r", committed, depth=2)) <= 2


def test_the_bigger_the_batch_the_likelier_a_looked_up_token_must_be():
    lookup = RunLookup(row_cost=0.07)
    floors = [lookup.min_path(b) for b in (1, 2, 4, 8, 16, 64)]
    assert floors == sorted(floors) and floors[0] == pytest.approx(0.07) and floors[-1] < 1
    committed = [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]  # after "9 1 2": 3 once, 4 once
    assert len(lookup.chain("a", committed, depth=4, batch=1)) >= 1
    assert len(lookup.chain("b", committed, depth=4, batch=16)) == 0  # a coin toss does not pay a full batch


def test_nothing_repeated_nothing_proposed_and_forget_drops_the_index():
    lookup = RunLookup()
    assert len(lookup.chain("r", list(range(40)), depth=8)) == 0
    assert "r" in lookup
    lookup.forget(["other"])
    assert "r" not in lookup
    with pytest.raises(ValueError):
        RunLookup(row_cost=0)


def test_feeding_the_tokens_as_they_come_proposes_what_a_fresh_index_over_all_of_them_does():
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(120)]  # a small alphabet: many repeats
    grown = RunLookup()
    for n in range(1, len(tokens), 7):
        fresh = RunLookup()
        assert grown.chain("r", tokens[:n], 6).tokens == fresh.chain("r", tokens[:n], 6).tokens


class TextEngine:
    """A target that writes a fixed text after each request's prompt: it accepts a draft while the draft is the
    text, then writes the text's next token. Records each verify_batch call."""

    verifies_trees = True
    kv_bytes_per_token = 0
    max_context = 200

    def __init__(self, prompts: dict[str, list[int]], text: list[int]):
        self.tokens = {rid: list(p) for rid, p in prompts.items()}
        self.starts = {rid: len(p) for rid, p in prompts.items()}
        self.text = text
        self.calls: list[list[tuple[str, DraftTree]]] = []

    def __contains__(self, request_id):
        return request_id in self.tokens

    def context_len(self, request_id):
        return len(self.tokens[request_id])

    def committed(self, request_id):
        return list(self.tokens[request_id])

    def hidden(self, request_id):  # no features: no feature head
        self.tokens[request_id]
        return None

    def verify_batch(self, items):
        self.calls.append([(rid, tree) for rid, tree, _ in items])
        out = []
        for rid, tree, _ in items:
            written = len(self.tokens[rid]) - self.starts[rid]
            accepted = 0
            for i in tree.main_chain():
                if tree.tokens[i] != self.text[written + accepted]:
                    break
                accepted += 1
            new = self.text[written:written + accepted + 1]
            self.tokens[rid] += new
            out.append(VerifyOutcome(new, accepted))
        return out


def run_rounds(engine, rounds: list[tuple[str, int, int]], lookup: RunLookup | None = None, sampling: Sampling = Sampling()):
    """Submit each (request id, steps, lookup) as one round; returns the outcomes and the reported steps."""
    async def go():
        worker = ModelWorker("test-lookup")
        steps: list[BatchStep] = []
        b = VerifyBatcher(engine, worker, on_batch=steps.append, lookup=lookup)
        try:
            return [o for o, _ in await asyncio.gather(*(b.submit(rid, DraftTree(), sampling, n, k)
                                                         for rid, n, k in rounds))], steps
        finally:
            await b.close()
            worker.shutdown()
    return asyncio.run(go())


def test_a_decode_run_with_lookup_commits_the_same_tokens_and_more_of_them_in_its_steps():
    verse = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    text = verse + [30] + verse + [31] * 300
    prompts = {"a": [1, 2, 3], "b": [4, 5]}
    plain = TextEngine(prompts, text)
    (pa, pb), plain_steps = run_rounds(plain, [("a", 24, 0), ("b", 24, 0)])
    looked = TextEngine(prompts, text)
    (la, lb), looked_steps = run_rounds(looked, [("a", 24, 8), ("b", 24, 0)])
    assert pa.token_ids == text[:24] and pb.token_ids == text[:24]
    assert la.token_ids[:24] == text[:24] and lb.token_ids == pb.token_ids  # the same text, "a" further on
    assert pa.lookup_drafted == 0 and lb.lookup_drafted == 0 and lb.lookup_accepted == 0  # only where allowed
    assert la.lookup_accepted > 0 and la.lookup_drafted >= la.lookup_accepted
    steps_of_a = sum(1 for call in looked.calls if "a" in dict(call))
    assert steps_of_a == 24 and len(la.token_ids) > 24  # the 24 steps asked for, more tokens
    assert len(la.token_ids) == 24 + la.lookup_accepted  # each step still commits the target's own token
    assert la.accepted_draft == 0  # no tree of its own
    # the reported steps count the looked-up positions
    assert sum(s.verified_tokens for s in looked_steps) == sum(1 + len(t) for call in looked.calls for _, t in call)
    assert len(plain_steps) == len(looked_steps) == 24  # "b" still takes a step a token


def test_lookup_stays_inside_the_context_and_the_batch_token_cap():
    text = [7, 8, 9] * 60
    engine = TextEngine({"a": [7, 8, 9, 7, 8, 9]}, text)
    engine.max_context = 30
    (a,), _ = run_rounds(engine, [("a", 40, 16)])
    assert len(engine.tokens["a"]) <= 30 and a.token_ids == text[:len(a.token_ids)]
    assert all(len(engine.tokens["a"]) <= 30 for _ in engine.calls)


def test_a_tree_and_lookup_in_one_round_is_refused():
    engine = TextEngine({"a": [1]}, [2] * 10)

    async def go():
        b = VerifyBatcher(engine, None)
        with pytest.raises(ValueError, match="looks tokens up only without a draft tree"):
            b.submit("a", DraftTree.chain([2], [0.9]), Sampling(), 1, 4)
    asyncio.run(go())


class ScriptedHead:
    """Stands in for the feature head in these policy tests (the real one runs in
    tests/unit/engine/test_feature_head.py): proposes a fixed chain with fixed probabilities, records its calls."""

    def __init__(self, tokens, probs, parents=None):
        self.tree = DraftTree(list(tokens), list(parents or range(-1, len(tokens) - 1)), list(probs))
        self.calls = []

    def trees(self, features, tokens, nodes, floor, chains=False):
        """The scripted tree's nodes whose path probability passes the floor, the first ``nodes`` of them."""
        self.calls.append((features.shape[0], list(tokens), nodes, floor))
        paths = self.tree.path_probs()
        keep = []
        for i, parent in enumerate(self.tree.parents):
            if paths[i] >= floor and (parent < 0 or parent in keep):
                keep.append(i)
        keep = keep[:nodes]
        where = {old: new for new, old in enumerate(keep)}
        tree = DraftTree([self.tree.tokens[i] for i in keep], [where.get(self.tree.parents[i], -1) for i in keep],
                         [self.tree.probs[i] for i in keep])
        return [tree] * len(tokens)


def test_chains_take_the_head_or_the_lookup_whichever_is_expected_to_add_more():
    import torch

    feature = torch.zeros(4)
    repeated = [5, 6, 7, 8, 9] * 3  # the lookup finds 5 6 7 8 9 after ... 8 9
    sure = ScriptedHead([40, 41, 42], [0.95, 0.9, 0.9])
    finder = RunLookup(head=sure)
    (tree, source), = finder.chains([("r", [1, 2, 3], 3, feature)], batch=1)
    assert source == "head" and tree.tokens == [40, 41, 42]  # nothing to look up; the head's path stays above 0.3
    assert sure.calls == [(1, [3], 3, finder.min_path(1))]
    unsure = RunLookup(head=ScriptedHead([40, 41], [0.35, 0.5]))
    (tree, source), = unsure.chains([("q", repeated, 2, feature)], batch=1)
    assert source == "lookup" and tree.tokens == [5, 6]  # a long repeat beats a head that is barely sure
    (tree, source), = unsure.chains([("s", [1, 2, 3], 2, feature)], batch=1)
    assert source == "head" and tree.tokens == [40]  # 0.35 pays alone (floor 0.3); 0.35·0.5 does not


def test_a_head_tree_counts_every_branch_it_is_expected_to_add():
    """Two likely first tokens, each passing the floor (0.3 alone) on its own: the head's tree keeps both, and
    the ask's node budget keeps its likeliest nodes."""
    import torch

    head = ScriptedHead([40, 50, 41], [0.45, 0.4, 0.8], parents=[-1, -1, 0])
    finder = RunLookup(head=head)
    (tree, source), = finder.chains([("r", [1, 2, 3], 3, torch.zeros(4))], batch=1)
    assert source == "head" and tree.parents == [-1, -1, 0] and tree.tokens == [40, 50, 41]
    (tree, source), = finder.chains([("q", [1, 2, 3], 2, torch.zeros(4))], batch=1)
    assert tree.tokens == [40, 50]  # the ask's node budget: the first nodes, which the head orders likeliest first


def test_the_head_does_not_run_without_a_feature_or_where_no_chain_could_pay():
    import torch

    head = ScriptedHead([40], [0.99])
    finder = RunLookup(head=head)
    assert finder.chains([("r", [1, 2, 3], 2, None)], batch=1) == [(DraftTree(), "")]
    assert finder.chains([("r", [1, 2, 3], 2, torch.zeros(4))], batch=16) == [(DraftTree(), "")]  # floor 0.87
    assert head.calls == []
    both = finder.chains([("a", [1, 2], 1, torch.zeros(4)), ("b", [3, 4], 1, None), ("c", [5], 1, torch.zeros(4))], 3)
    assert [s for _, s in both] == ["head", "", "head"] and head.calls == [(2, [2, 5], 1, finder.min_path(3))]
