"""A FakeBackend whose writes to chosen peers hang: a test double for the lane state machine
(transfer/lanes.py) ONLY. The real frozen peer is tested with Mooncake and SIGSTOP
(test_lanes.py, tests/e2e/chaos/test_freeze.py)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from tests.transfer.fake_backend import FakeBackend
from transfer.backend import Span, WriteStatus


@dataclass
class _Write:
    peer: str
    spans: list[Span]
    done: bool = False
    cancelled: bool = False


class GatedBackend(FakeBackend):
    """`frozen`: agents whose writes stay in flight (copied once thawed). `cancellable`: whether
    `cancel` can stop a write in flight. `stuck_submit`: agents whose `submit` blocks until
    `thaw` (a handshake to a frozen peer)."""

    def __init__(self, cancellable: bool = False) -> None:
        super().__init__()
        self.cancellable = cancellable
        self.frozen: set[str] = set()
        self.stuck_submit: set[str] = set()
        self.writes: list[_Write] = []
        self._lock = threading.Lock()
        self._thawed = threading.Condition(self._lock)

    def thaw(self, agent: str) -> None:
        with self._lock:
            self.frozen.discard(agent)
            self.stuck_submit.discard(agent)
            self._thawed.notify_all()

    def submit(self, peer: str, spans: list[Span]) -> Any:
        with self._lock:
            while peer in self.stuck_submit:
                self._thawed.wait()
        w = _Write(peer, spans)
        self.writes.append(w)
        return w

    def poll(self, handle: Any) -> WriteStatus:
        w: _Write = handle
        with self._lock:
            if w.cancelled:
                return WriteStatus.FAILED
            if w.peer in self.frozen:
                return WriteStatus.IN_FLIGHT
            if not w.done:
                for src, dst, n in w.spans:
                    ctypes.memmove(dst, src, n)
                w.done = True
        return WriteStatus.DONE

    def cancel(self, handle: Any) -> bool:
        w: _Write = handle
        with self._lock:
            if self.cancellable and not w.done:
                w.cancelled = True
            return w.done or w.cancelled

    def in_flight(self, agent: str) -> int:
        with self._lock:
            return sum(1 for w in self.writes if w.peer == agent and not (w.done or w.cancelled))
