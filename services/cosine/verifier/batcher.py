"""Continuous batching of verification rounds across requests.

Each Verify stream hands its round to `VerifyBatcher.verify` and awaits the
outcome. One loop takes every round that is waiting (up to `max_batch`) and
verifies them together in one forward pass of the engine (`verify_batch`;
engines without it verify one by one), so requests arriving while a batch runs
form the next batch instead of queueing one forward each.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from cosine.common.streams import ModelWorker
from cosine.engine.sampling import Sampling
from cosine.engine.tree import DraftTree


class Released(RuntimeError):
    """The request's cache was released before its round ran (its stream ended)."""


@dataclass
class _Pending:
    request_id: str
    tree: DraftTree
    sampling: Sampling
    future: asyncio.Future


class VerifyBatcher:
    def __init__(self, engine, worker: ModelWorker, max_batch: int = 8, on_batch=None):
        self.engine = engine
        self.worker = worker
        self.max_batch = max_batch
        self._on_batch = on_batch  # called with (batch size, seconds) after each batch
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def verify(self, request_id: str, tree: DraftTree, sampling: Sampling):
        """(the round's outcome: accepted tokens + the target's next, the size of the batch it was verified in)."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request_id, tree, sampling, future))
        self._wakeup.set()
        return await future

    def _verify_present(self, batch: list[_Pending]) -> dict[str, object]:
        """On the model thread: verify the rounds whose request still holds a cache."""
        live = [p for p in batch if p.request_id in self.engine]
        items = [(p.request_id, p.tree, p.sampling) for p in live]
        if hasattr(self.engine, "verify_batch"):
            outcomes = self.engine.verify_batch(items) if items else []
        else:
            outcomes = [self.engine.verify(*item) for item in items]
        return {p.request_id: o for p, o in zip(live, outcomes)}

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [p for p in self._queue[: self.max_batch] if not p.future.done()]
                del self._queue[: self.max_batch]
                if not batch:
                    continue
                started = time.perf_counter()
                try:
                    outcomes = await self.worker.run(self._verify_present, batch)
                except Exception as exc:  # noqa: BLE001 - every round of the batch learns of it
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                if self._on_batch is not None:
                    self._on_batch(len(batch), time.perf_counter() - started)
                for p in batch:
                    if p.future.done():
                        continue
                    outcome = outcomes.get(p.request_id)
                    if outcome is None:
                        p.future.set_exception(Released(f"request {p.request_id} was released"))
                    else:
                        p.future.set_result((outcome, len(outcomes)))

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
