"""Backpressure from decode: requests wait at the gateway, before their first token.

A decode worker reports its seats in GetInfo (`max_running_requests`: what its running batch
holds). The gateway sends a worker at most that many requests at once (`Worker.inflight`
counts them until the worker ends them, read or not: gateway/dispatcher.py `Dispatcher.left`),
and a request that finds every healthy decode worker full waits here, in arrival order, until
a seat frees. Prefill then computes only what decode can seat, so waiting
happens before the first token and never between two tokens of a stream (the worker reserves
the seat together with the pages, worker/decode.py).

The queue is bounded: past `gateway.max_queued_requests` a request is refused at once with 429
and Retry-After; one that waited `gateway.queue_timeout_s` gets 503 and Retry-After. The
Retry-After is the recent wait (an exponential average), at least 1 s. A worker that reports
no seats (0) is never full.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from gateway.errors import QueueFull, QueueTimeout
from gateway.metrics import Metrics
from gateway.pool import Worker
from gateway.waits import wait_event

RECHECK_S = 0.25  # the head of the queue looks again this often (health may have changed)
EWMA = 0.2  # weight of the newest wait in the Retry-After estimate


def has_seat(w: Worker) -> bool:
    """A request more fits on `w` (its reported seats, minus what this gateway has there)."""
    seats = w.info.max_running_requests if w.info is not None else 0
    return seats <= 0 or w.inflight < seats


class AdmissionQueue:
    """The gateway's queue for one pool. `acquire(pick)` returns a worker with a free seat;
    `wake()` is called whenever a seat frees."""

    def __init__(self, pool: str, max_queued: int, timeout_s: float, metrics: Metrics) -> None:
        self.pool = pool
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._waiters: deque[asyncio.Event] = deque()
        self._wait_s = 0.0  # exponential average of recent waits (Retry-After)
        self._depth = metrics.queue_depth.labels(pool)
        self._waited = metrics.queue_wait.labels(pool)
        self._full = metrics.queue_rejected.labels(pool, "full")
        self._timeout = metrics.queue_rejected.labels(pool, "timeout")

    def __len__(self) -> int:
        return len(self._waiters)

    async def acquire(self, pick: Callable[[], Worker | None]) -> Worker:
        """A worker with a free seat, from `pick` (None: all full; it raises when there is no
        healthy worker at all). Waits in arrival order; QueueFull / QueueTimeout."""
        if not self._waiters:
            w = pick()
            if w is not None:
                self._waited.observe(0.0)
                return w
        if len(self._waiters) >= self.max_queued:
            self._full.inc()
            raise QueueFull(f"{len(self._waiters)} requests already wait for a {self.pool} seat "
                            "(gateway.max_queued_requests); retry later",
                            code="queue_full", retry_after_s=self._retry_after())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        me = asyncio.Event()
        self._waiters.append(me)
        self._depth.set(len(self._waiters))
        try:
            while True:
                if self._waiters[0] is me:
                    w = pick()
                    if w is not None:
                        self._record(loop.time() - t0)
                        return w
                left = t0 + self.timeout_s - loop.time()
                if left <= 0:
                    self._timeout.inc()
                    self._record(self.timeout_s)
                    raise QueueTimeout(
                        f"no {self.pool} seat freed within {self.timeout_s:g} s "
                        "(gateway.queue_timeout_s); retry later", code="queue_timeout",
                        retry_after_s=self._retry_after())
                me.clear()
                # On a timeout, look again anyway: a worker may have turned healthy.
                await wait_event(me, min(left, RECHECK_S))
        finally:
            self._waiters.remove(me)
            self._depth.set(len(self._waiters))
            self.wake()  # the next in line looks now: more seats may be free

    def wake(self) -> None:
        """A seat freed (or the head left): let the head of the queue look."""
        if self._waiters:
            self._waiters[0].set()

    def _record(self, waited: float) -> None:
        self._waited.observe(waited)
        self._wait_s += EWMA * (waited - self._wait_s)

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._wait_s))
