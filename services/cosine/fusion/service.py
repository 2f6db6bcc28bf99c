"""gRPC adapter of fusion: one Speculate stream per request, driving that request's drafters."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from cosine.common.errors import ServiceError, invalid
from cosine.common.streams import close_quietly, exchange
from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from cosine.fusion.policy import merge_chains
from cosine.fusion.v1 import fusion_pb2, fusion_pb2_grpc

log = logging.getLogger(__name__)


class FusionServicer(fusion_pb2_grpc.FusionServicer):
    def __init__(self, drafters: dict[str, drafter_pb2_grpc.DrafterStub]):
        self.drafters = drafters

    async def ListDrafters(self, request, context):
        infos = await asyncio.gather(*(stub.Info(common_pb2.InfoRequest(), timeout=10) for stub in self.drafters.values()))
        return fusion_pb2.DrafterList(drafters=infos)

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):
        calls: dict[str, grpc.aio.StreamStreamCall] = {}
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
                    yield await self._round(calls, message.round)
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
            calls[name] = self.drafters[name].Draft(timeout=context.time_remaining())
            await calls[name].write(open_req)
        return calls

    async def _round(self, calls, round_msg) -> fusion_pb2.SpeculateResponse:
        started = time.perf_counter()
        step = drafter_pb2.DraftRequest(
            step=drafter_pb2.DraftStep(committed_token_ids=round_msg.committed_token_ids, depth=round_msg.depth)
        )
        try:
            replies = await asyncio.gather(*(exchange(call, step, f"drafter {name}") for name, call in calls.items()))
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"a drafter failed: {exc.details()}") from exc
        tree = merge_chains([(list(r.token_ids), list(r.probs)) for r in replies], budget=max(round_msg.depth, 1) * len(calls))
        return fusion_pb2.SpeculateResponse(
            tree=common_pb2.DraftTree(token_ids=tree.tokens, parents=tree.parents, probs=tree.probs),
            draft_ms=(time.perf_counter() - started) * 1000,
        )
