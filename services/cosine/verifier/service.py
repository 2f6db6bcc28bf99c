"""gRPC adapter of the verifier over the target engine: a scheduler's VerifySteps stream (one message per step, many
requests), or one Verify stream per request."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from cosine.common.errors import ServiceError, invalid, status_of
from cosine.common.streams import ModelWorker
from cosine.common.tracing import Tracing
from cosine.common.convert import sampling_from_proto
from cosine.common.v1 import common_pb2
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree
from cosine.verifier.batcher import Released, RoundOutcome, VerifyBatcher
from cosine.verifier.lookup import MAX_LOOKUP
from cosine.verifier.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)

MAX_DECODE_STEPS = 64  # most tokens one round may decode plainly (VerifyRound.steps)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine, worker: ModelWorker, name: str = "target", tokenizer_hash: str = "", max_slots: int = 256,
                 tracing: Tracing | None = None, batcher: VerifyBatcher | None = None, opened=None, lookup_tokens=None):
        self.engine = engine
        self.batcher = batcher or VerifyBatcher(engine, worker)
        self.tracing = tracing or Tracing("verifier")
        self.worker = worker
        self.name = name
        self.tokenizer_hash = tokenizer_hash
        self.max_slots = max_slots
        # streams holding or opening a KV cache: counted on the event loop before the open is awaited,
        # so two concurrent opens cannot both pass the check for the last slot
        self.slots_taken = 0
        self.open_ids: set[str] = set()  # request ids a stream holds here: a second open of one is refused
        self.opened = opened  # a Counter (child) of requests opened here, or None
        self.lookup_tokens = lookup_tokens  # a Counter by outcome (drafted, accepted) and source (lookup, head), or None

    async def Info(self, request, context):
        return common_pb2.ModelInfo(
            name=self.name,
            kind="target",
            vocab_size=self.engine.vocab_size,
            tokenizer_hash=self.tokenizer_hash,
            max_context=self.engine.max_context,
        )

    def _check_open(self, message: verifier_pb2.VerifyOpen) -> tuple[list[int], Sampling]:
        committed = list(message.committed_token_ids)
        if not committed:
            raise invalid("Verify open needs the committed token ids")
        if len(committed) >= self.engine.max_context:
            raise invalid(f"{len(committed)} tokens exceed the target's context of {self.engine.max_context}")
        if any(t >= self.engine.vocab_size for t in committed):
            raise invalid(f"token ids must be below the vocabulary size {self.engine.vocab_size}")
        sampling = sampling_from_proto(message.sampling)
        try:
            sampling.check()
        except ValueError as exc:
            raise invalid(str(exc)) from exc
        return committed, sampling

    def _take_slot(self) -> None:
        if self.slots_taken >= self.max_slots:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the verifier holds {self.max_slots} requests already; retry later")
        self.slots_taken += 1

    def _tree(self, message: verifier_pb2.VerifyRound) -> DraftTree:
        tree = DraftTree(list(message.tree.token_ids), list(message.tree.parents), list(message.tree.probs))
        try:
            tree.validate(self.engine.vocab_size)
        except ValueError as exc:
            raise invalid(str(exc)) from exc
        return tree

    @staticmethod
    def _steps(message: verifier_pb2.VerifyRound, tree: DraftTree) -> tuple[int, int]:
        """(plain steps, most looked-up tokens per step) the round asks for."""
        steps = max(1, message.steps)
        if steps > 1 and len(tree):
            raise invalid("a round asks for several plain steps only with an empty draft tree")
        if steps > MAX_DECODE_STEPS:
            raise invalid(f"a round decodes at most {MAX_DECODE_STEPS} steps, it asked for {steps}")
        if message.lookup and len(tree):
            raise invalid("a round asks for lookup only with an empty draft tree")
        if message.lookup > MAX_LOOKUP:
            raise invalid(f"a round looks up at most {MAX_LOOKUP} tokens a step, it asked for {message.lookup}")
        return steps, message.lookup

    async def VerifySteps(self, request_iterator, context: grpc.aio.ServicerContext):
        """A scheduler's steps: per message, releases, then the opens prefilled together (one `open_batch`),
        then every round queued at once (so the batcher chooses from all of them together); one answer per
        message. Entry errors stay entry errors."""
        held: dict[str, Sampling] = {}  # requests opened on this stream
        try:
            async for step in request_iterator:
                results: list[verifier_pb2.VerifyEntryResult | None] = []
                opens = []  # (result index, request id, committed, prompt_len)
                asked = []  # (result index, request id, round message)
                for entry in step.entries:
                    rid, kind = entry.request_id, entry.WhichOneof("kind")
                    if kind == "release":
                        if held.pop(rid, None) is not None:
                            self.worker.submit(self.engine.release, rid)
                            self.slots_taken -= 1
                            self.open_ids.discard(rid)
                        continue
                    try:
                        if not rid:
                            raise invalid("a VerifySteps entry needs a request_id")
                        if kind == "open":
                            committed, sampling = self._check_open(entry.open)
                            if rid in self.open_ids:  # never take over another stream's cache
                                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already open on the verifier")
                            self._take_slot()
                            held[rid] = sampling
                            self.open_ids.add(rid)
                            opens.append((len(results), rid, committed, entry.open.prompt_len))
                            results.append(None)
                        elif kind == "round":
                            asked.append((len(results), rid, entry.round))
                            results.append(None)
                        else:
                            raise invalid("a VerifySteps entry has neither open, round nor release")
                    except ServiceError as exc:
                        results.append(self._entry_error(rid, exc.code, exc.message))
                    except Exception as exc:  # noqa: BLE001 - this entry fails, the stream goes on
                        results.append(self._entry_error(rid, *status_of(exc)))
                if opens:
                    for (index, rid, *_), error in zip(opens, await self._open_all(opens)):
                        if error is None:
                            if self.opened is not None:
                                self.opened.inc()
                            results[index] = verifier_pb2.VerifyEntryResult(request_id=rid, opened=verifier_pb2.VerifyOpened())
                        else:
                            held.pop(rid, None)
                            self.open_ids.discard(rid)
                            self.slots_taken -= 1
                            results[index] = self._entry_error(rid, *error)
                rounds = []  # (result index, request id, tree, future, trace context)
                for index, rid, message in asked:
                    try:
                        if rid not in held:
                            raise invalid(f"round for request {rid}, which is not open on this stream")
                        tree = self._tree(message)
                        steps, lookup = self._steps(message, tree)
                        rounds.append((index, rid, tree, self.batcher.submit(rid, tree, held[rid], steps, lookup),
                                       message.trace_context))
                    except ServiceError as exc:
                        results[index] = self._entry_error(rid, exc.code, exc.message)
                    except Exception as exc:  # noqa: BLE001
                        results[index] = self._entry_error(rid, *status_of(exc))
                started = time.perf_counter()
                outcomes = await asyncio.gather(*(self._round(rid, tree, future, ctx) for _, rid, tree, future, ctx in rounds),
                                                return_exceptions=True)
                for (index, rid, *_), outcome in zip(rounds, outcomes):
                    if isinstance(outcome, BaseException):
                        code, message = ((grpc.StatusCode.FAILED_PRECONDITION, str(outcome)) if isinstance(outcome, Released)
                                         else status_of(outcome))
                        results[index] = self._entry_error(rid, code, message)
                    else:
                        outcome.verdict.verify_ms = (time.perf_counter() - started) * 1000
                        results[index] = outcome
                yield verifier_pb2.VerifyStepResult(results=results)
        finally:
            for rid in held:
                self.worker.submit(self.engine.release, rid)
                self.open_ids.discard(rid)
            self.slots_taken -= len(held)

    async def _open_all(self, opens) -> list[tuple[grpc.StatusCode, str] | None]:
        """Prefill the opens of one message in one engine call (`open_batch`: one forward for all their
        prompts, not one each); should that fail, each alone, so an error stays its own entry's."""
        items = [(rid, committed, prompt_len) for _, rid, committed, prompt_len in opens]
        try:
            await self.worker.run(self.engine.open_batch, items)
            return [None] * len(items)
        except Exception:  # noqa: BLE001 - find out which: each alone
            for rid, *_ in items:
                self.worker.submit(self.engine.release, rid)
        errors: list[tuple[grpc.StatusCode, str] | None] = []
        for item in items:
            try:
                await self.worker.run(self.engine.open, *item)
                errors.append(None)
            except ServiceError as exc:
                errors.append((exc.code, exc.message))
            except Exception as exc:  # noqa: BLE001 - this entry fails, the stream goes on
                errors.append(status_of(exc))
        return errors

    @staticmethod
    def _entry_error(rid: str, code: grpc.StatusCode, message: str) -> verifier_pb2.VerifyEntryResult:
        return verifier_pb2.VerifyEntryResult(request_id=rid, error=verifier_pb2.VerifyEntryError(
            code=code.value[0], message=message))

    async def _round(self, rid: str, tree: DraftTree, future: asyncio.Future, trace_context) -> verifier_pb2.VerifyEntryResult:
        with self.tracing.span("verifier.verify", {"cosine.tree_size": len(tree.tokens)}, parent=trace_context) as span:
            span.set_attribute("cosine.queue_depth", self.worker.pending)
            outcome, batch_size = await future
            span.set_attribute("cosine.batch_size", batch_size)
            span.set_attribute("cosine.accepted_length", outcome.accepted_draft)
        return verifier_pb2.VerifyEntryResult(request_id=rid, verdict=self._verdict(outcome))

    def _verdict(self, outcome: RoundOutcome) -> verifier_pb2.VerifyResponse:
        if self.lookup_tokens is not None and outcome.lookup_drafted:
            for source, drafted, accepted in (
                    ("lookup", outcome.lookup_drafted - outcome.head_drafted, outcome.lookup_accepted - outcome.head_accepted),
                    ("head", outcome.head_drafted, outcome.head_accepted)):
                if drafted:
                    self.lookup_tokens.labels("drafted", source).inc(drafted)
                    self.lookup_tokens.labels("accepted", source).inc(accepted)
        return verifier_pb2.VerifyResponse(token_ids=outcome.token_ids, accepted_draft=outcome.accepted_draft,
                                           lookup_drafted=outcome.lookup_drafted, lookup_accepted=outcome.lookup_accepted)

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        request_id = None
        holds_slot = False
        sampling = Sampling()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "open":
                    if request_id is not None:
                        raise invalid("Verify stream opened twice")
                    committed, sampling = self._check_open(message.open)
                    if message.open.request_id in self.open_ids:  # never take over another stream's cache
                        raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {message.open.request_id} is already open on the verifier")
                    self._take_slot()  # taken before the await: the check and the taking are one step
                    holds_slot = True
                    request_id = message.open.request_id
                    self.open_ids.add(request_id)
                    await self.worker.run(self.engine.open, request_id, committed, message.open.prompt_len)
                    if self.opened is not None:
                        self.opened.inc()
                elif kind == "round":
                    if request_id is None:
                        raise invalid("Verify round before open")
                    tree = self._tree(message.round)
                    steps, lookup = self._steps(message.round, tree)
                    started = time.perf_counter()
                    # rounds of concurrent requests share forward passes (see batcher.py); queue_depth: model calls ahead
                    with self.tracing.span("verifier.verify", {"cosine.tree_size": len(tree.tokens)},
                                           parent=message.round.trace_context) as span:
                        span.set_attribute("cosine.queue_depth", self.worker.pending)
                        outcome, batch_size = await self.batcher.verify(request_id, tree, sampling, steps, lookup)
                        span.set_attribute("cosine.batch_size", batch_size)
                        span.set_attribute("cosine.accepted_length", outcome.accepted_draft)
                    verdict = self._verdict(outcome)
                    verdict.verify_ms = (time.perf_counter() - started) * 1000
                    yield verdict
                else:
                    raise invalid("Verify message has neither open nor round")
        finally:
            if request_id is not None:
                # the worker runs calls in order, so an open queued after this release finds the slot free
                self.open_ids.discard(request_id)
                self.worker.submit(self.engine.release, request_id)
            if holds_slot:
                self.slots_taken -= 1
