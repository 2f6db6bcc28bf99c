"""gRPC adapter of fusion: one Speculate stream per request, driving that request's drafters."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from prometheus_client import Counter

from cosine.common.errors import ServiceError, invalid
from cosine.common.streams import close_quietly, exchange
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from cosine.fusion.policy import merge_chains
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc

log = logging.getLogger(__name__)


class FusionMetrics:
    """Acceptance by drafter: a drafter's chain of round k is compared with the tokens the
    target accepted, which arrive as round k+1's committed tokens (so a request's last
    round is not counted). Labels: drafter names of the deployment, a bounded set."""

    def __init__(self, registry=None):
        self.proposed = Counter("cosine_fusion_drafter_proposed_tokens_total", "tokens each drafter proposed", ["drafter"], registry=registry)
        self.accepted = Counter(
            "cosine_fusion_drafter_accepted_tokens_total", "proposed tokens on the path the target accepted", ["drafter"], registry=registry)

    def judge(self, chains: dict[str, list[int]], committed: list[int]) -> None:
        """committed: accepted drafts then the target's own token, so at most len - 1 are drafts."""
        accepted_path = committed[:-1]
        for name, chain in chains.items():
            agreed = 0
            for proposed, taken in zip(chain, accepted_path):
                if proposed != taken:
                    break
                agreed += 1
            self.proposed.labels(name).inc(len(chain))
            self.accepted.labels(name).inc(agreed)


class FusionServicer(fusion_pb2_grpc.FusionServicer):
    def __init__(self, drafters: dict[str, drafter_pb2_grpc.DrafterStub], metrics: FusionMetrics | None = None,
                 tracing: Tracing | None = None):
        self.drafters = drafters
        self.metrics = metrics or FusionMetrics()
        self.tracing = tracing or Tracing("fusion")

    async def ListDrafters(self, request, context):
        infos = await asyncio.gather(*(stub.Info(common_pb2.InfoRequest(), timeout=10, metadata=self.tracing.metadata()) for stub in self.drafters.values()))
        return fusion_pb2.DrafterList(drafters=infos)

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        calls: dict[str, grpc.aio.StreamStreamCall] = {}
        chains: dict[str, list[int]] = {}  # the previous round's proposals, judged when its outcome arrives
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    if calls:
                        raise invalid("Speculate stream opened twice")
                    calls = await self._open(message.open, context)
                elif kind == "round":
                    if not calls:
                        raise invalid("Speculate round before open")
                    if chains:
                        self.metrics.judge(chains, list(message.round.committed_token_ids))
                    response, chains = await self._round(calls, message.round)
                    yield response
                else:
                    raise invalid("Speculate message has neither open nor round")
        finally:
            for call in calls.values():
                close_quietly(call)

    async def _open(self, open_msg, context) -> dict[str, grpc.aio.StreamStreamCall]:
        names = list(dict.fromkeys(open_msg.drafters))
        if not names:
            raise invalid("Speculate open names no drafter")
        unknown = [n for n in names if n not in self.drafters]
        if unknown:
            raise invalid(f"unknown drafter(s) {unknown}; this fusion node has {sorted(self.drafters)}")
        calls = {}
        open_req = drafter_pb2.DraftRequest(
            open=drafter_pb2.DraftOpen(request_id=open_msg.request_id, prompt_token_ids=open_msg.prompt_token_ids)
        )
        for name in names:
            calls[name] = self.drafters[name].Draft(timeout=context.time_remaining(), metadata=self.tracing.metadata())
            await calls[name].write(open_req)
        return calls

    async def _round(self, calls, round_msg) -> tuple[fusion_pb2.SpeculateResponse, dict[str, list[int]]]:
        started = time.perf_counter()
        with self.tracing.span("fusion.round", {"cosine.depth": round_msg.depth, "cosine.drafters": len(calls)},
                               parent=round_msg.trace_context) as span:
            step = drafter_pb2.DraftRequest(
                step=drafter_pb2.DraftStep(committed_token_ids=round_msg.committed_token_ids, depth=round_msg.depth)
            )
            self.tracing.inject(step.step.trace_context)
            try:
                replies = await asyncio.gather(*(exchange(call, step, f"drafter {name}") for name, call in calls.items()))
            except grpc.aio.AioRpcError as exc:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"a drafter failed: {exc.details()}") from exc
            tree = merge_chains([(list(r.token_ids), list(r.probs)) for r in replies], budget=max(round_msg.depth, 1) * len(calls))
            span.set_attribute("cosine.tree_size", len(tree.tokens))
        chains = {name: list(r.token_ids) for name, r in zip(calls, replies)}
        return fusion_pb2.SpeculateResponse(
            tree=common_pb2.DraftTree(token_ids=tree.tokens, parents=tree.parents, probs=tree.probs),
            draft_ms=(time.perf_counter() - started) * 1000,
        ), chains
