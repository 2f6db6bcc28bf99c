"""A simulated clock for asyncio: an event loop whose time jumps to the next timer instead of waiting for it.

`VirtualTimeLoop` is asyncio's own selector loop with two changes: `time()` returns a
virtual clock, and when the loop would block (nothing ready, a timer due in t seconds)
the clock advances by t at once. Every `asyncio.sleep`, `call_later` and timeout then
runs in simulated time, in the order the real loop would run them (asyncio's timer heap:
by due time; timers due at the same instant in an order that is deterministic, run to run,
but not necessarily the order they were scheduled in), so unmodified asyncio code — the
scheduler's step loop and its adapter — becomes a discrete-event simulation: a
component that takes 12 ms is `await asyncio.sleep(0.012)`.

The loop does no I/O; if it would wait forever (no timer, nothing ready) the
simulation is stuck and `SimulationStalled` is raised instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is due: the simulated system waits for an event that never comes."""


class _VirtualSelector:
    def __init__(self, loop: "VirtualTimeLoop", real: selectors.BaseSelector):
        self._loop, self._real = loop, real

    def select(self, timeout: float | None = None):
        events = self._real.select(0)  # the loop's own self-pipe only; never blocks
        if events:
            return events
        if timeout is None:
            raise SimulationStalled("the simulation has no event left to wait for")
        if timeout > 0:
            self._loop._now += timeout
        return []

    def __getattr__(self, name):
        return getattr(self._real, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        super().__init__()
        self._now = float(start)
        self._selector = _VirtualSelector(self, self._selector)

    def time(self) -> float:
        return self._now


class LoopClock:
    """The step loop's `Clock` on the running event loop's time (simulated under `VirtualTimeLoop`)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def run(main: Awaitable[T]) -> T:
    """Run a coroutine to completion on a fresh `VirtualTimeLoop` (simulated seconds start at 0)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
