"""gRPC adapter of one drafter: a Draft stream per request over an engine Drafter."""

from __future__ import annotations

import logging

import grpc

from cosine.common.errors import ServiceError, invalid
from cosine.common.streams import ModelWorker
from cosine.common.tracing import Tracing
from cosine.common.v1 import common_pb2
from cosine.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from cosine.engine.drafters import Drafter
from cosine.engine.kv_cache import SlotsFull

log = logging.getLogger(__name__)

MAX_TOP_K = 16  # candidates per position a step may ask for


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter, worker: ModelWorker, tokenizer_hash: str = "", max_depth: int = 32,
                 tracing: Tracing | None = None, opened=None):
        self.drafter = drafter
        self.tracing = tracing or Tracing(drafter.name)
        self.worker = worker
        self.tokenizer_hash = tokenizer_hash
        self.max_depth = max_depth
        self.open_ids: set[str] = set()  # request ids a stream holds here: a second open of one is refused
        self.opened = opened  # a Counter (child) of requests opened here, or None

    async def Info(self, request, context):
        return common_pb2.ModelInfo(
            name=self.drafter.name,
            kind=self.drafter.kind,
            vocab_size=self.drafter.vocab_size,
            tokenizer_hash=self.tokenizer_hash,
            domain=self.drafter.domain,
        )

    async def Draft(self, request_iterator, context: grpc.aio.ServicerContext):
        request_id = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    if request_id is not None:
                        raise invalid("Draft stream opened twice")
                    if not message.open.prompt_token_ids:
                        raise invalid("Draft open needs the prompt's token ids")
                    if message.open.request_id in self.open_ids:  # never take over another stream's cache
                        raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                                           f"request {message.open.request_id} is already open on drafter {self.drafter.name}")
                    request_id = message.open.request_id
                    self.open_ids.add(request_id)
                    try:
                        await self.worker.run(self.drafter.open, request_id, list(message.open.prompt_token_ids))
                    except SlotsFull:
                        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"drafter {self.drafter.name} has no free KV slot; retry later") from None
                    if self.opened is not None:
                        self.opened.inc()
                    if message.open.score_prompt:  # expertise routing's prior: answer the open
                        fit = await self.worker.run(self.drafter.score_prompt, request_id)
                        yield drafter_pb2.DraftResponse(prompt_fit=common_pb2.PromptFit(
                            drafter=self.drafter.name, positions=fit.positions, hits=fit.hits,
                            confidence_sum=fit.confidence_sum, logprob_sum=fit.logprob_sum or 0.0,
                            has_logprob=fit.logprob_sum is not None))
                elif kind == "step":
                    if request_id is None:
                        raise invalid("Draft step before open")
                    step = message.step
                    depth = min(step.depth, self.max_depth)
                    committed, context = list(step.committed_token_ids), list(step.context_token_ids)
                    with self.tracing.span("drafter.step", {"cosine.drafter": self.drafter.name, "cosine.depth": depth},
                                           parent=step.trace_context) as span:
                        span.set_attribute("cosine.queue_depth", self.worker.pending)
                        if step.top_k > 0:
                            response = await self.worker.run(
                                self._candidates, request_id, committed, depth, context, min(step.top_k, MAX_TOP_K))
                        else:
                            tokens, probs = await self.worker.run(
                                self.drafter.draft, request_id, committed, depth, *((context,) if context else ()))
                            response = drafter_pb2.DraftResponse(token_ids=tokens, probs=probs)
                        span.set_attribute("cosine.proposed_tokens", len(response.token_ids))
                    yield response
                else:
                    raise invalid("Draft message has neither open nor step")
        finally:
            if request_id is not None:
                # the worker runs calls in order: an open of the same id queued after this finds it released
                self.open_ids.discard(request_id)
                self.worker.submit(self.drafter.release, request_id)

    def _candidates(self, request_id: str, committed: list[int], depth: int, context: list[int], top_k: int) -> drafter_pb2.DraftResponse:
        """`depth` positions, each with its top_k candidates; the chain continues with each position's first."""
        response = drafter_pb2.DraftResponse()
        chain: list[int] = []
        for i in range(depth):
            cands = self.drafter.propose(request_id, committed if i == 0 else [], context + chain, top_k)
            if not cands:
                break
            response.token_ids.append(cands[0][0])
            response.probs.append(cands[0][1])
            response.candidates.add(token_ids=[t for t, _ in cands], probs=[p for _, p in cands])
            chain.append(cands[0][0])
        if depth <= 0 and committed:
            self.drafter.draft(request_id, committed, 0)  # still take the committed tokens
        return response
