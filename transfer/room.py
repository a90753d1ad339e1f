"""Room states, counters, and the deadline/finish logic shared by sender and receiver.

A room is one request's KV hand-off between a prefill rank (sender) and a decode rank
(receiver). Both sides walk the same states:

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS | FAILED | ABORTED

Every non-terminal state has a deadline from TransferConfig; `poll()` expires it. A room
finishes exactly once (later finishes are ignored), and the manager hands each finished room to
the engine exactly once (`take_finished`), which is when the engine frees the room's pages.

A room that fails names the side at fault (`fault`: the one that stopped answering or sent bad
data) and whether it timed out; both sides agree on it (FAILED events carry it), so the
gateway blames the worker that failed, never the bystander on the other end.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from transfer.config import TransferConfig, TransferConfigError


class RoomRequestError(ValueError):
    """A new room's fields from the request are unusable: that request is refused, the worker
    and its other rooms go on."""


class RoomExistsError(RoomRequestError):
    """A new room's id is one this rank still holds (live, or ended and not yet taken). The
    request that repeats it is refused; the room's first owner goes on."""


class NoBootstrapAddrError(RoomRequestError, TransferConfigError):
    """A decode room names no prefill bootstrap address to register with."""

class RoomState(enum.Enum):
    # sender: waiting for decode's registration(s); receiver: registering
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"  # paired; prefill is still computing the prompt
    TRANSFERRING = "transferring"  # last writes issued, not all confirmed
    SUCCESS = "success"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED, RoomState.ABORTED)


class Side(enum.Enum):
    """A side of a room; on the wire as its value (RoomEvent.fault)."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> Side:
        return Side.DECODE if self is Side.PREFILL else Side.PREFILL


@dataclass
class RoomStats:
    """What moved for one room (sender: summed over decode ranks; receiver: over prefill ranks)."""

    pages: int = 0  # page positions written (per destination rank)
    bytes: int = 0
    writes: int = 0  # backend batches
    duration_ms: float = 0.0  # first write issued (sender) / registration (receiver) -> confirmed


@dataclass(frozen=True)
class TransferTotals:
    """Manager-wide counters since start."""

    rooms_succeeded: int = 0
    rooms_failed: int = 0
    rooms_aborted: int = 0
    pages: int = 0
    bytes: int = 0
    writes: int = 0


class Room:
    """State, deadline and error of one room; subclasses add the protocol.

    All state lives under the manager's lock (`lock`), shared with the gRPC and transfer threads.
    """

    side: Side  # which end of the room this object is (the sender is prefill's)

    def __init__(
        self, room: int, config: TransferConfig, lock: threading.RLock,
        on_finish: Callable[[Room], None],
    ) -> None:
        self.room = room
        self.error: str | None = None
        self.fault: Side | None = None  # who failed the room (None: it succeeded, or was aborted)
        self.timed_out = False  # a deadline passed, or the peer stopped answering
        self.stats = RoomStats()
        self._config = config
        self._lock = lock
        self._on_finish = on_finish
        self._state = RoomState.BOOTSTRAPPING
        self._deadline = time.monotonic() + config.bootstrap_timeout_s

    @property
    def state(self) -> RoomState:
        return self._state

    def _timeout_of(self, state: RoomState) -> float:
        return {
            RoomState.BOOTSTRAPPING: self._config.bootstrap_timeout_s,
            RoomState.WAITING_FOR_INPUT: self._config.waiting_timeout_s,
            RoomState.TRANSFERRING: self._config.transfer_timeout_s,
        }[state]

    def _enter(self, state: RoomState) -> None:
        """Move to a non-terminal state and restart its deadline (caller holds the lock)."""
        assert not state.finished and not self._state.finished
        if state != self._state:
            self._state = state
            self._deadline = time.monotonic() + self._timeout_of(state)

    def _late_side(self, state: RoomState) -> Side:
        """Whose step is overdue when `state`'s deadline passes (default: the other side's)."""
        return self.side.other

    def poll(self) -> RoomState:
        """Expire the current state's deadline; never blocks on I/O."""
        with self._lock:
            state = self._state
            if not state.finished and time.monotonic() > self._deadline:
                name = {RoomState.BOOTSTRAPPING: "bootstrap_timeout_s",
                        RoomState.WAITING_FOR_INPUT: "waiting_timeout_s",
                        RoomState.TRANSFERRING: "transfer_timeout_s"}[state]
                late = self._late_side(state)
                self._finish(RoomState.FAILED, f"room {self.room:#x}: deadline in {state.value} "
                             f"passed (transfer.{name}={self._timeout_of(state)}s; waiting on "
                             f"{late.value})", fault=late, timed_out=True)
            return self._state

    def abort(self, reason: str) -> None:
        """End the room now, whatever its state; idempotent; tells the peer."""
        with self._lock:
            self._finish(RoomState.ABORTED, reason)

    def _finish(self, state: RoomState, reason: str | None, *, fault: Side | None = None,
                timed_out: bool = False) -> bool:
        """Enter a terminal state once (caller holds the lock); False if already finished.
        `fault`: the side that failed the room; `timed_out`: it stopped answering in time."""
        assert state.finished
        if self._state.finished:
            return False
        self._state = state
        self.error = reason if state is not RoomState.SUCCESS else None
        if state is not RoomState.SUCCESS:
            self.fault, self.timed_out = fault, timed_out
        self._on_terminal(state, reason)
        self._on_finish(self)
        return True

    def _on_terminal(self, state: RoomState, reason: str | None) -> None:
        """Tell the peer (subclass hook; runs under the lock, must not block)."""
