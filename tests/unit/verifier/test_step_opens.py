"""The verifier prefills the opens of one VerifySteps message together (one `open_batch`), and an open's
error stays that entry's: the other opens and the message's rounds go on."""

from __future__ import annotations

import grpc
import pytest

from cosine.common.streams import ModelWorker
from cosine.common.v1 import common_pb2
from cosine.engine.hf_target import VerifyOutcome
from cosine.verifier.service import VerifierServicer
from cosine.verifier.v1 import verifier_pb2

pytestmark = pytest.mark.unit


class RecordingEngine:
    """Records each open_batch and open call; `broken` ids fail to open (as a full cache would)."""

    vocab_size = 100
    max_context = 64
    verifies_trees = True
    kv_bytes_per_token = 0

    def __init__(self, broken=()):
        self.broken = set(broken)
        self.held: dict[str, list[int]] = {}
        self.opened: list[str] = []  # every successful open (the stream's end releases them on the worker, which
        # may or may not run before the test's worker shuts down: `held` at the end is a race, this is not)
        self.batches: list[list[str]] = []
        self.singles: list[str] = []

    def __len__(self):
        return len(self.held)

    def __contains__(self, request_id):
        return request_id in self.held

    def context_len(self, request_id):
        return len(self.held[request_id])

    def committed(self, request_id):
        return list(self.held[request_id])

    def hidden(self, request_id):  # no features: no feature head
        self.held[request_id]
        return None

    def open(self, request_id, committed, prompt_len):
        self.singles.append(request_id)
        if request_id in self.broken:
            raise RuntimeError("all KV cache slots are in use")
        self.held[request_id] = list(committed)
        self.opened.append(request_id)

    def open_batch(self, items):
        self.batches.append([rid for rid, *_ in items])
        for rid, committed, _ in items:
            if rid in self.broken:
                raise RuntimeError("all KV cache slots are in use")
            self.held[rid] = list(committed)
            self.opened.append(rid)

    def release(self, request_id):
        self.held.pop(request_id, None)

    def verify_batch(self, items):
        return [VerifyOutcome([7], 0) for _ in items]


def opening(rid: str, tokens=(1, 2, 3)) -> verifier_pb2.VerifyEntry:
    return verifier_pb2.VerifyEntry(request_id=rid, open=verifier_pb2.VerifyOpen(
        request_id=rid, committed_token_ids=list(tokens), prompt_len=len(tokens), sampling=common_pb2.SamplingParams()))


def round_of(rid: str) -> verifier_pb2.VerifyEntry:
    return verifier_pb2.VerifyEntry(request_id=rid, round=verifier_pb2.VerifyRound())


async def one_step(engine, entries) -> list[verifier_pb2.VerifyEntryResult]:
    worker = ModelWorker("test-step-opens")
    servicer = VerifierServicer(engine, worker, max_slots=8)
    try:
        async def messages():
            yield verifier_pb2.VerifyStep(entries=entries)

        answers = [answer async for answer in servicer.VerifySteps(messages(), None)]
    finally:
        worker.shutdown()
    assert len(answers) == 1
    return list(answers[0].results)


async def test_a_steps_opens_are_prefilled_in_one_call_and_its_rounds_verified_after():
    engine = RecordingEngine()
    results = await one_step(engine, [opening("a"), opening("b"), round_of("a"), opening("c"), round_of("b")])
    assert engine.batches == [["a", "b", "c"]] and engine.singles == []
    kinds = [(r.request_id, r.WhichOneof("kind")) for r in results]
    assert kinds == [("a", "opened"), ("b", "opened"), ("a", "verdict"), ("c", "opened"), ("b", "verdict")]
    assert list(results[2].verdict.token_ids) == [7]


async def test_an_open_that_fails_fails_alone():
    """One open of the batch cannot be prefilled: the others are opened one by one, and the failed one's
    round is refused as not open; a bad open (token beyond the vocabulary) never reaches the engine."""
    engine = RecordingEngine(broken={"b"})
    results = await one_step(engine, [opening("a"), opening("b"), opening("bad", (1, 500)), round_of("b"),
                                      round_of("a"), opening("c")])
    assert engine.batches == [["a", "b", "c"]] and engine.singles == ["a", "b", "c"]
    by_entry = [(r.request_id, r.WhichOneof("kind")) for r in results]
    assert by_entry == [("a", "opened"), ("b", "error"), ("bad", "error"), ("b", "error"), ("a", "verdict"),
                        ("c", "opened")]
    assert results[1].error.code == grpc.StatusCode.INTERNAL.value[0]  # the engine's error, its text kept back
    assert "slots" not in results[1].error.message
    assert results[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert results[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert engine.opened == ["a", "a", "c"]  # the batch opened "a" before "b" failed it; then one by one, "b" failing


async def test_a_round_asking_for_several_steps_gets_them_and_bad_asks_fail_alone():
    engine = RecordingEngine()
    tree = common_pb2.DraftTree(token_ids=[5], parents=[-1], probs=[0.5])
    results = await one_step(engine, [
        opening("a"), opening("b"), opening("c"),
        verifier_pb2.VerifyEntry(request_id="a", round=verifier_pb2.VerifyRound(steps=3)),
        verifier_pb2.VerifyEntry(request_id="b", round=verifier_pb2.VerifyRound(tree=tree, steps=2)),
        verifier_pb2.VerifyEntry(request_id="c", round=verifier_pb2.VerifyRound(steps=65))])
    assert list(results[3].verdict.token_ids) == [7, 7, 7]  # three plain steps, answered at once
    for bad in results[4:]:
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "empty draft tree" in results[4].error.message and "at most 64" in results[5].error.message


async def test_a_round_allowing_lookup_gets_its_verdict_with_the_lookups_counts_and_bad_asks_fail_alone():
    engine = RecordingEngine()
    tree = common_pb2.DraftTree(token_ids=[5], parents=[-1], probs=[0.5])
    results = await one_step(engine, [
        opening("a"), opening("b"), opening("c"),
        verifier_pb2.VerifyEntry(request_id="a", round=verifier_pb2.VerifyRound(steps=2, lookup=4)),
        verifier_pb2.VerifyEntry(request_id="b", round=verifier_pb2.VerifyRound(tree=tree, lookup=4)),
        verifier_pb2.VerifyEntry(request_id="c", round=verifier_pb2.VerifyRound(lookup=17))])
    verdict = results[3].verdict
    assert list(verdict.token_ids) == [7, 7] and verdict.lookup_accepted <= verdict.lookup_drafted
    for bad in results[4:]:
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "empty draft tree" in results[4].error.message and "at most 16" in results[5].error.message
