"""One Generate call is one connected trace across all five services, with the round structure."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from opentelemetry.trace import SpanKind

from cosine.common.v1 import common_pb2
from cosine.router.v1 import router_pb2, router_pb2_grpc

from .conftest import start_services, stop_services

SERVICES = {"router", "scheduler", "fusion", "drafter-ngram", "drafter-tiny", "verifier"}


@pytest.fixture(scope="module")
async def traced(tiny_dirs, redis_server):
    started = await start_services(tiny_dirs, redis_server, trace_exporter="memory")
    yield started
    await stop_services(started)


def finished_spans(services) -> list:
    spans = []
    for name in SERVICES:
        spans += services[name].tracing.memory.get_finished_spans()
    return spans


# (the verifier is reached over the scheduler's long-lived VerifySteps stream, shared by every request: its
# server span is no part of one request's trace; each round's verifier.verify span is)
STREAMS = {"cosine.router.v1.Router/Generate": 1, "cosine.scheduler.v1.Scheduler/Submit": 1, "cosine.fusion.v1.Fusion/Speculate": 1,
           "cosine.drafter.v1.Drafter/Draft": 2}


async def all_ended(services, timeout_s: float = 10.0) -> list:
    """The spans once every stream's server span has ended (downstream streams close just after the reply)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        spans = finished_spans(services)
        names = Counter(s.name for s in spans)
        if all(names[n] >= k for n, k in STREAMS.items()) or asyncio.get_running_loop().time() > deadline:
            return spans
        await asyncio.sleep(0.05)


async def generate(address: str, **fields) -> router_pb2.Final:
    async with grpc.aio.insecure_channel(address) as channel:
        final = None
        async for reply in router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(**fields), timeout=60):
            if reply.WhichOneof("kind") == "final":
                final = reply.final
        return final


@pytest.mark.parametrize("fusion", [common_pb2.FUSION_MODE_MERGE, common_pb2.FUSION_MODE_CONFIDENCE])
async def test_one_generate_is_one_connected_trace(traced, fusion):
    for name in SERVICES:
        traced[name].tracing.memory.clear()
    final = await generate(traced.router, prompt=b"a b c a b c a b c", max_new_tokens=12,
                           speculation={"drafters": ["ngram", "tiny"], "fusion": fusion, "pipelining": False})
    assert final is not None and final.stats.rounds > 0
    spans = await all_ended(traced)
    by_id = {s.context.span_id: s for s in spans}
    services_of = {s.resource.attributes["service.name"] for s in spans}
    assert services_of == SERVICES

    # one trace, and every span but the root has its parent in it
    assert len({s.context.trace_id for s in spans}) == 1
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["cosine.router.v1.Router/Generate"] and roots[0].kind == SpanKind.SERVER
    assert all(s.parent.span_id in by_id for s in spans if s.parent is not None)

    def parent_name(span) -> str:
        return by_id[span.parent.span_id].name

    names = Counter(s.name for s in spans)
    rounds = names["scheduler.round"]
    assert rounds == final.stats.rounds
    # per round: draft → fusion.round → a step on each drafter; verify → verifier.verify; commit
    assert names["scheduler.verify"] == names["verifier.verify"] == names["scheduler.commit"] == rounds
    assert names["scheduler.draft"] == names["fusion.round"] >= 1
    if fusion == common_pb2.FUSION_MODE_MERGE:  # each drafter drafts its chain in one step
        assert names["drafter.step"] == 2 * names["fusion.round"]
    else:  # confidence fusion: one step per drafter and fused position
        steps = sum(s.attributes["cosine.steps"] for s in spans if s.name == "fusion.round")
        assert steps >= names["fusion.round"] and names["drafter.step"] == 2 * steps
    for span in spans:
        if span.name in ("scheduler.draft", "scheduler.verify", "scheduler.commit"):
            assert parent_name(span) == "scheduler.round"
        elif span.name == "scheduler.round":
            assert parent_name(span) == "cosine.scheduler.v1.Scheduler/Submit"
        elif span.name == "fusion.round":  # (drafting ahead, with pipelining on, is a child of scheduler.round)
            assert parent_name(span) == "scheduler.draft"
        elif span.name == "drafter.step":
            assert parent_name(span) == "fusion.round"
        elif span.name == "verifier.verify":
            assert parent_name(span) == "scheduler.verify"
        elif span.name == "cosine.scheduler.v1.Scheduler/Submit":
            assert parent_name(span) == "cosine.router.v1.Router/Generate"
        elif span.name in ("cosine.fusion.v1.Fusion/Speculate", "cosine.verifier.v1.Verifier/Verify"):
            assert parent_name(span) == "cosine.scheduler.v1.Scheduler/Submit"
        elif span.name == "cosine.drafter.v1.Drafter/Draft":
            assert parent_name(span) == "cosine.fusion.v1.Fusion/Speculate"
        elif span.name == "cosine.fusion.v1.Fusion/ListDrafters":  # the router's drafter directory, when it refreshes
            assert parent_name(span) == "cosine.router.v1.Router/Generate"
        elif span.name == "cosine.drafter.v1.Drafter/Info":
            assert parent_name(span) == "cosine.fusion.v1.Fusion/ListDrafters"
        elif span.parent is not None:
            pytest.fail(f"unexpected span {span.name}")

    # the figures that matter for speculation are on the spans
    # (the first round opens the request on the verifier and is plain: adaptive depth drafts from the second)
    first_round = next(s for s in spans if s.name == "scheduler.round" and s.attributes["cosine.round"] == 0)
    assert first_round.attributes["cosine.depth"] == 0
    second = next(s for s in spans if s.name == "scheduler.round" and s.attributes["cosine.round"] == 1)
    assert {"cosine.depth", "cosine.drafters", "cosine.tree_size", "cosine.accepted_length"} <= set(second.attributes)
    assert second.attributes["cosine.drafters"] == 2
    verify = [s for s in spans if s.name == "verifier.verify"]
    assert sum(s.attributes["cosine.accepted_length"] for s in verify) == final.stats.accepted_tokens
    assert all(s.attributes["cosine.batch_size"] == 1 for s in verify)
    generate_span = roots[0]
    assert generate_span.attributes["cosine.completion_tokens"] == final.usage.completion_tokens


async def test_tracing_off_creates_nothing(services):
    # the shared stack runs with the default settings: no provider, no interceptor, no-op spans
    for name in SERVICES:
        tracing = services[name].tracing
        assert not tracing.enabled and tracing.memory is None and tracing.interceptors() == []
        assert tracing.metadata() is None
        with tracing.span("x") as span:
            assert not span.is_recording()
