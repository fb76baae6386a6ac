"""Simulated time for unmodified asyncio code.

The round engine waits with ``asyncio.sleep`` and ``asyncio.wait_for`` and reads a clock.
Run it on :class:`VirtualClockLoop` and those waits pass in simulated seconds: whenever
nothing is runnable, the loop jumps straight to its next timer instead of sleeping. Work
handed to threads (``asyncio.to_thread``) runs inline, so it takes no simulated time and
the order of events never depends on thread timing: the same inputs give the same run.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from flotilla.core.errors import SimulationStalled

T = TypeVar("T")


class _JumpingSelector(selectors.BaseSelector):
    """Delegates to a real selector, but a wait for the next timer advances the clock."""

    def __init__(self, loop_now: Callable[[float], None]) -> None:
        self._real = selectors.DefaultSelector()
        self._advance = loop_now

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled(
                "the simulation stalled: tasks are waiting, but no timer is scheduled"
            )
        self._advance(timeout)
        return []

    def get_map(self) -> Any:
        return self._real.get_map()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def close(self) -> None:
        self._real.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is simulated seconds, starting at ``start``."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        super().__init__(selector=_JumpingSelector(self._advance))

    def _advance(self, seconds: float) -> None:
        self._now += seconds

    def time(self) -> float:
        return self._now

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Run ``func`` now, on this thread: it takes no simulated time."""
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as exc:  # handed to the awaiting task, as a thread would
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            future.set_exception(exc)
        return future


def run_simulated(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """``asyncio.run`` on a :class:`VirtualClockLoop`."""
    loop = VirtualClockLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
