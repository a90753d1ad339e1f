"""Drain: a worker leaves without failing a request.

Lifecycle (SIGTERM, or `Drain` from the gateway when an operator DELETEs the worker):
  1. `request(reason)`: the state becomes DRAINING; GetInfo reports `draining`, health says
     NOT_SERVING, and Generate refuses new requests with UNAVAILABLE (so a gateway retries them
     on another worker before their first token; no request means no new room either).
  2. `run(...)` waits until the worker holds nothing (no live call, nothing running or
     waiting, no live room, no used page: late-write quarantines included), bounded by
     `drain_timeout_s`; past it, what is left is aborted and its pages freed.
  3. DRAINED: the server stops and the process exits 0.
A second request while draining changes nothing (idempotent); a second SIGTERM stops at once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tandem.worker")

_POLL_S = 0.05  # the engine signals no "idle" event: its counters are read at this period
_ABORT_GRACE_S = 5.0  # after aborting the leftovers, time for their pages to come back


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"


@dataclass(frozen=True)
class Holdings:
    """What a worker still holds; `idle` once all of it is zero."""

    calls: int  # live Generate calls (their streams are open)
    running: int
    waiting: int
    rooms: int  # live rooms, any state
    used_pages: int  # full-attention and window pages held by requests, rooms, quarantines

    @property
    def idle(self) -> bool:
        return not (self.calls or self.running or self.waiting or self.rooms or self.used_pages)

    def describe(self) -> str:
        return (
            f"{self.calls} calls, {self.running} running, {self.waiting} waiting, "
            f"{self.rooms} rooms, {self.used_pages} used pages"
        )


class Drainer:
    """The worker's drain state machine (owned by the gRPC service, driven by serve())."""

    def __init__(self, timeout_s: float, on_start: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.state = DrainState.SERVING
        self.reason = ""
        self.requested = asyncio.Event()  # serve() waits on it beside its stop event
        self._on_start = on_start  # e.g. a joined worker tells its gateway it leaves

    @property
    def draining(self) -> bool:
        return self.state is not DrainState.SERVING

    def request(self, reason: str) -> None:
        """Start draining (idempotent). Call on the worker's event loop."""
        if self.state is DrainState.SERVING:
            self.state = DrainState.DRAINING
            self.reason = reason
            log.info(
                "draining (%s): refusing new requests; up to %.0f s to finish the rest",
                reason,
                self.timeout_s,
            )
            self.requested.set()
            if self._on_start is not None:
                self._on_start()

    async def run(
        self, holdings: Callable[[], Holdings], abort_all: Callable[[str], int]
    ) -> Holdings:
        """Wait (bounded) until nothing is held; abort the leftovers at the deadline.

        Returns what was still held at the end (idle unless even the aborts did not free it).
        """
        t0 = time.monotonic()
        held = holdings()
        log.info("drain: holding %s", held.describe())
        deadline = t0 + self.timeout_s
        while not held.idle and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
            held = holdings()
        if not held.idle:
            n = abort_all(f"worker drain timed out after {self.timeout_s:g} s")
            log.warning(
                "drain: timed out after %.0f s holding %s; aborted %d requests",
                self.timeout_s,
                held.describe(),
                n,
            )
            grace = time.monotonic() + _ABORT_GRACE_S
            while not held.idle and time.monotonic() < grace:
                await asyncio.sleep(_POLL_S)
                held = holdings()
        self.state = DrainState.DRAINED
        if held.idle:
            log.info("drained in %.2f s: every page free; exiting", time.monotonic() - t0)
        else:
            log.error("drain: still holding %s after aborting; exiting anyway", held.describe())
        return held
