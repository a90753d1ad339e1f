"""Deadlines on the gateway's waits for workers and clients.

`StallWatch` ends output streams whose worker went quiet after the first token (dispatch.py's
`RequestRun.next` turns the cancelled read into the stall error); `_timeout` bounds one await
(the first token, a stream's end, a request body) without a task per request;
`FirstTokenDeadline` bounds a wait for the first token (PD's, also against its prefill leg);
`wait_done` bounds a wait for a task's end.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from gateway.pool import WorkerPool

if sys.version_info >= (3, 11):
    _timeout = asyncio.timeout  # no task per request, unlike wait_for
else:  # pragma: no cover - 3.10 fallback
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def _timeout(delay: float) -> AsyncIterator[None]:
        task = asyncio.current_task()
        assert task is not None
        handle = asyncio.get_running_loop().call_later(delay, task.cancel)
        try:
            yield
        except asyncio.CancelledError:
            raise asyncio.TimeoutError from None
        finally:
            handle.cancel()


async def wait_done(task: asyncio.Future[Any], timeout_s: float) -> None:
    """Wait until `task` is done or `timeout_s` passed, whichever comes first; neither
    cancels it nor raises its error (asyncio.wait's contract for one task, at half its cost:
    no set, no second future)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    handle = loop.call_later(timeout_s, wake)
    try:
        await waiter
    finally:
        handle.cancel()
        task.remove_done_callback(wake)


class Interruptible(Protocol):
    def interrupt(self, exc: BaseException | None) -> None: ...


class DeadlinePassed(Exception):
    """Raised by a leg's read when its FirstTokenDeadline passed."""


class FirstTokenDeadline:
    """A wait for a leg's first token, bounded with one timer (no task, no `asyncio.wait`):
    it ends at `timeout_s`, or (PD) `stall_s` after the prefill leg ended well (decode then
    holds all it needs), whichever comes first; a failed prefill leg ends it at once with that
    leg's error. Each ending interrupts the leg's read (DeadlinePassed, or the prefill error).
    Mono has no prefill leg: only `timeout_s` ends it. `stop()` once the wait is over, however
    it ended: nothing reaches the leg after."""

    __slots__ = ("_leg", "_loop", "_stall_s", "_when", "_timer", "landed")

    def __init__(self, leg: Interruptible, timeout_s: float, stall_s: float) -> None:
        self._leg = leg
        self._loop = asyncio.get_running_loop()
        self._stall_s = stall_s
        self._when = self._loop.time() + timeout_s
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self._when, self._expire)
        self.landed = False  # the prefill leg ended well: the KV and first token are on decode

    def prefill_ended(self, task: asyncio.Task[None]) -> None:
        if self._timer is None or task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._leg.interrupt(exc)
            return
        self.landed = True
        when = self._loop.time() + self._stall_s
        if when < self._when:
            self._timer.cancel()
            self._when = when
            self._timer = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer = None
        self._leg.interrupt(DeadlinePassed())

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._leg.interrupt(None)


class Watched(Protocol):
    """What the watch reads of a stream (dispatch.RequestRun): no back-reference to the run's
    dispatcher, only the time its pending read began and the way to end it."""

    reading_since: float  # monotonic time the pending read began; 0: no read pending

    def stall(self) -> None: ...


class StallWatch:
    """Ends streams whose worker went quiet: one task per gateway looks every `period` at the
    streams waiting for a message (a timer per token would cost ~20 us each; this costs two
    clock reads). A stream stalled past `stall_s` has its call cancelled; its reader turns
    that into the stall error. Detection lands within stall_s + period."""

    def __init__(self, stall_s: float, pool: WorkerPool) -> None:
        self.stall_s = stall_s
        self.period = min(0.5, stall_s / 4)
        self._pool = pool
        self._runs: set[Watched] = set()
        self._started = False

    def add(self, run: Watched) -> None:
        self._runs.add(run)
        if not self._started:
            self._started = True
            self._pool.spawn(self._watch())

    def discard(self, run: Watched) -> None:
        self._runs.discard(run)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            now = time.monotonic()
            for run in [r for r in self._runs if r.reading_since > 0]:
                if now - run.reading_since > self.stall_s:
                    run.stall()
