"""hivemind's progress tracker, with an event loop that ends clean.

hivemind 1.1.12's ``ProgressTracker`` runs its reporter and fetcher on a loop of its own
thread and returns as soon as both stop, leaving the DHT requests and waits they had in
flight pending on a loop nobody closes; when the process exits, asyncio reports each as
``ERROR asyncio: Task was destroyed but it is pending!`` (every Ctrl-C of a volunteer).
Here the leftovers are cancelled and awaited, and the loop is closed.
"""

from __future__ import annotations

import asyncio

from hivemind.optim.progress_tracker import ProgressTracker


class TidyProgressTracker(ProgressTracker):  # type: ignore[misc]
    """``ProgressTracker`` whose thread cancels what its loop left pending, then closes it."""

    def run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                asyncio.gather(self._progress_reporter(), self._progress_fetcher())
            )
        finally:
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            loop.close()
            self.shutdown_complete.set()
