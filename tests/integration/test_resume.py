"""Submit with resume, straight at a real scheduler (real Redis, tiny models): a request is taken over from
its Redis state and continues where it was, every token carries its index, the stream it was taken from is
fenced off (ABORTED), an ended request only sends what its caller lacks, and an unknown one starts afresh."""

from __future__ import annotations

import time

import grpc
import pytest
from transformers import AutoTokenizer

from cosine.common.v1 import common_pb2
from cosine.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.faults.conftest import greedy  # noqa: F401 - a fixture

PROMPT = "A short history of the bicycle"
N = 40


@pytest.fixture
def submit_request(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["target"]))

    def make(rid: str, **fields) -> scheduler_pb2.SubmitRequest:
        return scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=tok(PROMPT)["input_ids"], max_new_tokens=N,
                                           sampling=common_pb2.SamplingParams(), stop_token_ids=[tok.eos_token_id],
                                           speculation=common_pb2.SpeculationParams(drafters=["ngram"]), **fields)
    return make


async def read_all(call) -> tuple[list[tuple[int, list[int]]], object]:
    chunks, final = [], None
    async for reply in call:
        if reply.WhichOneof("kind") == "tokens":
            chunks.append((reply.tokens.start_index, list(reply.tokens.token_ids)))
        elif reply.WhichOneof("kind") == "final":
            final = reply.final
    return chunks, final


def joined(chunks) -> list[int]:
    out = []
    for start, ids in chunks:
        assert start == len(out), f"a gap or an overlap at {start} (have {len(out)})"
        out += ids
    return out


async def test_a_resume_takes_the_request_over_and_fences_the_old_stream(services, greedy, submit_request):
    rid = f"resume-{time.time_ns()}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services['scheduler'].port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        first = stub.Submit(submit_request(rid), timeout=60)
        got = []
        async for reply in first:  # a few rounds on the first stream, then a resume as if it had broken
            assert reply.tokens.start_index == len(got)
            got += reply.tokens.token_ids
            if len(got) >= 5:
                break
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # a second plain Submit of a running id is refused
            await read_all(stub.Submit(submit_request(rid), timeout=60))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        chunks, final = await read_all(stub.Submit(submit_request(rid, resume=True, resume_from=len(got)), timeout=60))
        assert chunks and chunks[0][0] == len(got)  # from the caller's index on
        assert got + joined([(s - len(got), ids) for s, ids in chunks]) == greedy(PROMPT, N)
        assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_EOS)
        with pytest.raises(grpc.aio.AioRpcError) as fenced:  # the stream it was taken from is ended
            async for _ in first:
                pass
        assert fenced.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)

        # it ended: a resume only sends what its caller lacks, and the final
        chunks, again = await read_all(stub.Submit(submit_request(rid, resume=True, resume_from=7), timeout=60))
        assert len(greedy(PROMPT, N)) > 7 and joined([(s - 7, ids) for s, ids in chunks]) == greedy(PROMPT, N)[7:]
        assert again.finish_reason == final.finish_reason


async def test_a_resume_of_a_request_redis_does_not_know_starts_afresh(services, greedy, submit_request):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{services['scheduler'].port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        chunks, final = await read_all(stub.Submit(submit_request(f"fresh-{time.time_ns()}", resume=True, resume_from=3), timeout=60))
    assert joined(chunks) == greedy(PROMPT, N)  # from index 0: the caller's index fence drops what it has
    assert final is not None


async def test_a_draining_scheduler_hands_a_new_request_back_at_once(services, submit_request):
    servicer = services["scheduler"].servicer
    servicer.draining = True
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services['scheduler'].port}") as channel:
            replies = [r async for r in scheduler_pb2_grpc.SchedulerStub(channel).Submit(submit_request(f"drain-{time.time_ns()}"), timeout=10)]
    finally:
        servicer.draining = False
    assert [r.WhichOneof("kind") for r in replies] == ["handover"]  # the router resubmits it to another scheduler
