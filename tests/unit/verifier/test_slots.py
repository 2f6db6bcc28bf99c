"""The verifier's slot check and the taking of a slot are one step: concurrent opens never overfill it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from cosine.common.errors import ServiceError
from cosine.common.streams import ModelWorker
from cosine.common.v1 import common_pb2
from cosine.verifier.service import VerifierServicer
from cosine.verifier.v1 import verifier_pb2


class SlowOpenEngine:
    """Holds at most `n_slots` requests (as the native engine's cache does); open waits for a gate."""

    vocab_size = 100
    max_context = 64
    verifies_trees = True
    kv_bytes_per_token = 0

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.held: set[str] = set()
        self.gate = threading.Event()

    def __len__(self):
        return len(self.held)

    def __contains__(self, request_id):
        return request_id in self.held

    def open(self, request_id, committed, prompt_len):
        self.gate.wait(5)
        if len(self.held) >= self.n_slots:
            raise RuntimeError("all KV cache slots are in use")
        self.held.add(request_id)

    def release(self, request_id):
        self.held.discard(request_id)


def open_message(rid: str) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(
        request_id=rid, committed_token_ids=[1, 2, 3], prompt_len=3, sampling=common_pb2.SamplingParams()))


async def stream(servicer, rid: str, hold: asyncio.Event):
    async def messages():
        yield open_message(rid)
        await hold.wait()  # keep the stream (and its slot) open until told

    async for _ in servicer.Verify(messages(), None):
        pass


async def test_two_opens_racing_for_the_last_slot_one_is_refused():
    engine = SlowOpenEngine(n_slots=1)
    worker = ModelWorker("test-slots")
    servicer = VerifierServicer(engine, worker, max_slots=1)
    hold = asyncio.Event()
    try:
        first = asyncio.create_task(stream(servicer, "a", hold))
        second = asyncio.create_task(stream(servicer, "b", hold))
        await asyncio.sleep(0.1)  # both open messages read; a's open still waits at the gate
        engine.gate.set()
        with pytest.raises(ServiceError) as refused:
            await asyncio.wait_for(second, 5)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        await asyncio.sleep(0.1)
        assert engine.held == {"a"} and not first.done()
        hold.set()
        await asyncio.wait_for(first, 5)
        await asyncio.sleep(0.1)  # the release runs on the worker after the stream ends
        assert engine.held == set() and servicer.slots_taken == 0
        # the slot is free again for a new stream
        again = asyncio.Event()
        third = asyncio.create_task(stream(servicer, "c", again))
        await asyncio.sleep(0.1)
        assert engine.held == {"c"}
        again.set()
        await asyncio.wait_for(third, 5)
    finally:
        worker.shutdown()
