"""Rendered answers of the read routes, kept until the model says they changed.

A dashboard polls nothing: it refetches what a ``change`` event names. Many dashboards
refetch the same thing at once after a round commits, so the read app renders each answer
once per change (one build in flight per key, the others wait for it) and serves the same
bytes until the next change of that kind. Committed rounds never change, so each round's
JSON is rendered once and a job's list is the join of those fragments.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

from flotilla.dashboard import render
from flotilla.dashboard.model import Change, RoundView

log = logging.getLogger(__name__)

#: A cache key: the route's name and its arguments.
Key = tuple[str, ...]


@dataclass(slots=True)
class _Entry:
    body: bytes
    built_at: float


class Responses:
    """Bodies by key, dropped by :meth:`changed`. For keys whose source changes without
    telling (devices' last seen, volunteer runs' status) ``max_age_s`` says when to read
    them again: the old answer is still served while a fresh one is built in the
    background, so no request waits for that rebuild."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[Key, _Entry] = {}
        self._building: dict[Key, asyncio.Future[bytes]] = {}
        #: Bumped by every change that touches a key, so a build that started before the
        #: change does not store what it read.
        self._generation: dict[Key, int] = {}
        self._refreshing: set[asyncio.Task[bytes]] = set()

    async def get(
        self, key: Key, build: Callable[[], Awaitable[bytes]], max_age_s: float | None = None
    ) -> bytes:
        entry = self._entries.get(key)
        if entry is not None:
            if max_age_s is not None and self._clock() - entry.built_at >= max_age_s:
                self._refresh(key, build)
            return entry.body
        return await self._build(key, build)

    def _refresh(self, key: Key, build: Callable[[], Awaitable[bytes]]) -> None:
        if key in self._building:
            return
        task = asyncio.ensure_future(self._build(key, build))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[bytes]) -> None:
        self._refreshing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("refreshing a cached answer failed: %s", task.exception())

    async def _build(self, key: Key, build: Callable[[], Awaitable[bytes]]) -> bytes:
        pending = self._building.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._building[key] = future
        generation = self._generation.get(key, 0)
        try:
            body = await build()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            self._building.pop(key, None)
        if self._generation.get(key, 0) == generation:
            self._entries[key] = _Entry(body, self._clock())
        future.set_result(body)
        return body

    def changed(self, change: Change) -> None:
        """Forget every answer ``change`` makes stale."""
        if change.kind == "job":
            keys: list[Key] = [("jobs",)]
            if change.job_id:
                keys += [("job", change.job_id), ("rounds", change.job_id)]
            else:
                keys += [k for k in self._entries if k[0] in ("job", "rounds")]
        elif change.kind == "devices":
            keys = [("devices",)]
        elif change.kind == "volunteers":
            keys = [("volunteers",)]
        else:
            keys = list(self._entries)
        for key in keys:
            self._entries.pop(key, None)
            self._generation[key] = self._generation.get(key, 0) + 1


class RoundFragments:
    """Each committed round's JSON, rendered once (a round is immutable once committed);
    bounded, the least recently used dropped first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._capacity = capacity
        self._fragments: OrderedDict[Hashable, bytes] = OrderedDict()

    def render(self, job_id: str, r: RoundView) -> bytes:
        # The commit time is in the key: a simulation's output directory may be rewritten
        # by a new run, whose round 3 is not the old round 3.
        key = (job_id, r.round, r.committed_at, r.checkpoint_sha256)
        fragment = self._fragments.get(key)
        if fragment is None:
            fragment = render.dumps(render.round_json(r))
            self._fragments[key] = fragment
            if len(self._fragments) > self._capacity:
                self._fragments.popitem(last=False)
        else:
            self._fragments.move_to_end(key)
        return fragment
