"""The verifier's batch policy wired into VerifyBatcher, on constructed queues and a fake engine."""

from __future__ import annotations

import asyncio

import pytest

from cosine.common.streams import ModelWorker
from cosine.engine.hf_target import VerifyOutcome
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree, cut_tree
from cosine.common.batching import BatchLimits, VerifyTimeModel
from cosine.verifier.batcher import BatchStep, VerifyBatcher, _Pending, expected_committed


class FakeEngine:
    """Accepts every draft token; records the (request id, tree) of each verify_batch call."""

    verifies_trees = True
    kv_bytes_per_token = 0

    def __init__(self, contexts: dict[str, int]):
        self.contexts = dict(contexts)
        self.calls: list[list[tuple[str, DraftTree]]] = []

    def __contains__(self, request_id):
        return request_id in self.contexts

    def context_len(self, request_id):
        return self.contexts[request_id]

    def verify_batch(self, items):
        self.calls.append([(rid, tree) for rid, tree, _ in items])
        return [VerifyOutcome(list(tree.tokens) + [0], len(tree)) for _, tree, _ in items]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def chain(n: int, p: float = 0.9) -> DraftTree:
    return DraftTree.chain(list(range(1, n + 1)), [p] * n)


def pending(rid: str, tree: DraftTree, queued_at: float = 100.0) -> _Pending:
    return _Pending(rid, tree, Sampling(), None, queued_at)  # future unused by choose()


def batcher(engine, policy="objective", max_batch=16, clock=None, **limits) -> VerifyBatcher:
    return VerifyBatcher(engine, worker=None, max_batch=max_batch, policy=policy, limits=BatchLimits(**limits),
                         time_model=VerifyTimeModel([0.01, 1e-4, 0.0, 0.0]), clock=clock or Clock())


def test_expected_committed_sums_path_probabilities_over_the_tree():
    t = DraftTree([5, 6, 7], [-1, 0, -1], [0.5, 0.5, 0.25])
    assert expected_committed(t) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert expected_committed(t, chain_only=True) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_committed(t, 1) == pytest.approx(1.5)
    assert expected_committed(DraftTree()) == 1.0


def test_cut_tree_is_a_prefix_and_a_tree():
    t = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1], [0.9, 0.8, 0.7, 0.6])
    cut = cut_tree(t, 2)
    assert (cut.tokens, cut.parents, cut.probs) == ([5, 6], [-1, 0], [0.9, 0.8])
    cut.validate(10)
    assert cut_tree(t, 9) is t


def test_a_chain_above_a_floor_stops_where_its_path_probability_falls_below_it():
    t = DraftTree.chain_above([5, 6, 7], [0.9, 0.5, 0.8], 0.4)
    assert t.tokens == [5, 6] and t.is_chain() and t.path_probs() == pytest.approx([0.9, 0.45])
    assert len(DraftTree.chain_above([5], [0.3], 0.4)) == 0
    assert DraftTree([5, 6, 7], [-1, 0, -1], [0.5, 0.5, 0.25]).path_probs() == pytest.approx([0.5, 0.25, 0.25])


def test_fifo_takes_the_oldest_up_to_max_batch_whatever_the_trees():
    engine = FakeEngine({f"r{i}": 10 for i in range(5)})
    queue = [pending(f"r{i}", chain(50)) for i in range(5)]
    batch, trims = batcher(engine, policy="fifo", max_batch=3, max_tokens=8).choose(queue)
    assert [p.request_id for p in batch] == ["r0", "r1", "r2"] and trims == {}


def test_a_token_cap_below_one_position_per_round_defers_the_rest():
    engine = FakeEngine({f"r{i}": 10 for i in range(4)})
    queue = [pending(f"r{i}", chain(4)) for i in range(4)]
    batch, trims = batcher(engine, max_tokens=3).choose(queue)
    assert len(batch) == 3  # one position each: the fourth waits
    assert sum(1 + trims.get(j, len(p.tree)) for j, p in enumerate(batch)) <= 3


def test_the_longest_trees_are_shortened_first_to_the_cap():
    engine = FakeEngine({"a": 10, "b": 10, "c": 10})
    queue = [pending("a", chain(2)), pending("b", chain(8)), pending("c", chain(5))]
    batch, trims = batcher(engine, max_tokens=12).choose(queue)
    assert [p.request_id for p in batch] == ["a", "b", "c"]
    kept = [trims.get(j, len(p.tree)) for j, p in enumerate(batch)]
    assert sum(1 + k for k in kept) == 12
    assert kept == [2, 4, 3]  # 15 draft tokens cut to 9: from the 8 and the 5, the 2 untouched


def test_max_batch_defers_and_deadline_takes_the_overdue_first():
    clock = Clock()
    engine = FakeEngine({"old": 10, "new1": 10, "new2": 10})
    # the old round is worth little (a plain round), the new ones much; past the deadline the old one goes first
    queue = [pending("old", DraftTree(), queued_at=99.0), pending("new1", chain(6, 1.0)), pending("new2", chain(6, 1.0))]
    b = batcher(engine, max_batch=1, clock=clock, deadline_s=0.5, w_wait=0.0)
    batch, _ = b.choose(queue)
    assert [p.request_id for p in batch] == ["old"]
    no_deadline = batcher(engine, max_batch=1, clock=clock, w_wait=0.0)
    assert [p.request_id for p in no_deadline.choose(queue)[0]] == ["new1"]


async def _run_rounds(b: VerifyBatcher, rounds: list[tuple[str, DraftTree]]) -> list:
    # all queued before the loop first runs, so the first step sees every round
    return await asyncio.gather(*(b.verify(rid, tree, Sampling()) for rid, tree in rounds))


async def test_deferred_round_goes_in_the_next_batch_and_trimmed_tree_is_a_prefix():
    engine = FakeEngine({"a": 10, "b": 20, "c": 30})
    worker = ModelWorker("test-batcher")
    steps: list[BatchStep] = []
    b = VerifyBatcher(engine, worker, max_batch=2, on_batch=steps.append, policy="objective",
                      limits=BatchLimits(max_tokens=6))
    trees = {"a": chain(3), "b": chain(3), "c": chain(9, 0.3)}  # c is worth least: it waits
    try:
        results = await _run_rounds(b, list(trees.items()))
    finally:
        await b.close()
        worker.shutdown()
    first, second = engine.calls
    assert [rid for rid, _ in first] == ["a", "b"]  # max_batch 2: c waits
    assert [rid for rid, _ in second] == ["c"]  # ... and goes next
    c_tree = second[0][1]
    assert len(c_tree) == 5 and c_tree.tokens == trees["c"].tokens[:5] and c_tree.parents == trees["c"].parents[:5]
    assert [s.deferred for s in steps] == [1, 0] and [s.trimmed for s in steps] == [2, 1]
    assert [s.verified_tokens for s in steps] == [6, 6]
    assert results[2][0].token_ids == trees["c"].tokens[:5] + [0]
    assert len(b.time_model.samples) == 2  # the batcher measures its own steps


async def test_nothing_starves_under_a_stream_of_better_rounds():
    """One plain round among rounds that keep coming with confident trees and max_batch 1: the deadline takes it."""
    engine = FakeEngine({"plain": 10, **{f"r{i}": 10 for i in range(40)}})

    class SlowWorker(ModelWorker):
        async def run(self, fn, *args):
            await asyncio.sleep(0.01)
            return fn(*args)

    worker = SlowWorker("test-starve")
    b = VerifyBatcher(engine, worker, max_batch=1, policy="objective",
                      limits=BatchLimits(max_tokens=64, deadline_s=0.05, w_wait=0.0))
    done: list[str] = []

    async def feeder(rid):
        await b.verify(rid, chain(6, 1.0), Sampling())
        done.append(rid)

    async def plain():
        await b.verify("plain", DraftTree(), Sampling())
        done.append("plain")

    try:
        tasks = [asyncio.create_task(feeder("r0")), asyncio.create_task(feeder("r1")), asyncio.create_task(plain())]
        for i in range(2, 40, 2):  # two new confident rounds per step taking one: the queue never runs dry
            await asyncio.sleep(0.01)
            tasks += [asyncio.create_task(feeder(f"r{i}")), asyncio.create_task(feeder(f"r{i + 1}"))]
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        await b.close()
        worker.shutdown()
    assert done.index("plain") < 15  # without the deadline it is last: every new round is worth more


class GrowingEngine(FakeEngine):
    """Each verified position adds one token to the request's context (up to max_context)."""

    max_context = 14

    def verify_batch(self, items):
        outcomes = super().verify_batch(items)
        for (rid, tree, _), o in zip(items, outcomes):
            self.contexts[rid] += len(o.token_ids)
        return [VerifyOutcome(o.token_ids[:-1] + [self.contexts[rid]], o.accepted_draft)
                for (rid, *_), o in zip(items, outcomes)]


async def test_a_decode_run_steps_its_requests_back_to_back_and_answers_once():
    engine = GrowingEngine({"run": 5, "tree": 5, "one": 5, "full": 11})
    worker = ModelWorker("test-batcher-runs")
    steps: list[BatchStep] = []
    b = VerifyBatcher(engine, worker, on_batch=steps.append)
    try:
        futures = [b.submit("run", DraftTree(), Sampling(), steps=4), b.submit("tree", chain(2), Sampling()),
                   b.submit("one", DraftTree(), Sampling()), b.submit("full", DraftTree(), Sampling(), steps=5)]
        (run, _), (tree, _), (one, _), (full, _) = await asyncio.gather(*futures)
        with pytest.raises(ValueError, match="only without a draft tree"):
            b.submit("tree", chain(1), Sampling(), steps=2)
    finally:
        await b.close()
        worker.shutdown()
    # the first step holds every round; then only the runs, while they have steps left and context
    assert [sorted(rid for rid, _ in call) for call in engine.calls] == [
        ["full", "one", "run", "tree"], ["full", "run"], ["full", "run"], ["run"]]
    assert all(not len(t) for call in engine.calls[1:] for _, t in call)  # plain steps
    assert run.token_ids == [6, 7, 8, 9] and run.accepted_draft == 0  # one token a step, in order
    assert tree.token_ids == [1, 2, 8] and tree.accepted_draft == 2 and one.token_ids == [6]
    assert full.token_ids == [12, 13, 14]  # stopped when its context was full
    assert [s.size for s in steps] == [4, 2, 2, 1]  # each step reported as the step it is
