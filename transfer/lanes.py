"""Per-peer write lanes: KV writes to different decode ranks never wait on each other.

Every decode agent this prefill rank writes to gets a lane: a thread with a bounded queue of
WriteJobs. The lane submits a job's ranges without blocking (`TransferBackend.submit`), polls
every write it has in flight, and ends each one when it is confirmed, fails, or its room ends
(the room's deadline or an abort). A write whose room ended is cancelled where the backend can
(NIXL, CUDA IPC); Mooncake cannot stop one, so the lane keeps polling it as an orphan: the room
has failed already, but the job still counts as in flight (ReleaseRoom waits for it) until it
is over, so decode never reuses pages it could still land in.

A write unconfirmed for transfer_timeout_s fences the peer (it stopped answering): its queued
and in-flight writes fail now, blaming the peer, later ones fail without being tried, and new
registrations from it are refused. The fence lifts when the peer answers again: a write to it
(an orphan finishing late, or a probe: one write let through once transfer_timeout_s has
passed since the fence, with no orphan still pending) is confirmed.

The manager's supervisor (`Writer.check`, from `poll_all`) also fences a lane whose thread is
stuck inside a backend call (a handshake to a frozen peer can block), so its queue fails on
time too.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transfer.backend import BackendError, TransferBackend, TransferFaults, WriteStatus
from transfer.plan import split_ranges
from transfer.receiver import crc_of
from transfer.room import Side
from transfer.sender import WriteFailure, WriteJob

log = logging.getLogger(__name__)

CORRUPT_BYTES = 64 * 1024  # garbage written at the start of each page by the corrupt= drill
MAX_QUEUED = 4096  # jobs waiting in one lane; past it a job fails at once (the peer is stuck)
MAX_IN_FLIGHT = 16  # jobs one lane has submitted and not yet seen end
IDLE_EXIT_S = 30.0  # an idle, unfenced lane's thread exits (a new job starts it again)
POLL_MIN_S, POLL_MAX_S = 0.0001, 0.002  # poll back-off while writes are in flight


class PeerState(enum.Enum):
    """How a lane treats its peer. Entered in this order; a probe's success returns to ACTIVE."""

    ACTIVE = "active"  # writes flow
    PROBING = "probing"  # fenced a while: one write is let through to see whether it answers
    FENCED = "fenced"  # a write went unconfirmed past transfer_timeout_s: writes fail at once


@dataclass
class _Flight:
    """A job this lane has started (only the lane's thread touches it)."""

    job: WriteJob
    started: float
    crc: int | None  # of the source bytes (transfer.checksum), taken before the write
    submit_at: float  # the delay drill holds the backend write until then (it lands regardless)
    fail: bool = False  # the fail drill: report failure instead of writing
    corrupt: bool = False  # the corrupt drill: overwrite the landed pages after the write
    handle: Any = None  # the backend's; None until submitted
    released: bool = False  # the handle was given back (cancelled, or ended)
    orphan: bool = False  # failed already (room ended, timed out) but not stoppable: polled on
    reported: bool = False  # the sender heard the job's result (exactly once)


@dataclass(frozen=True)
class WriterContext:
    """What every lane of one manager shares (the manager builds it once)."""

    backend: TransferBackend
    kv_ptr: int  # this rank's registered pool: sources are offsets from here
    page_bytes: int
    scratch: int  # registered garbage source of the corrupt drill (CORRUPT_BYTES)
    checksum: bool
    timeout_s: float  # transfer_timeout_s
    faults: Callable[[], TransferFaults]  # the manager's current drill (replaceable at run time)
    on_result: Callable[[WriteJob, WriteFailure | None, int, int | None], None]
    on_settled: Callable[[WriteJob], None]  # nothing of the job can land any more


class PeerLane:
    """Writes to one decode agent, on their own thread.

    Locking: `_cond` guards the queue and the state; callbacks into the manager (which take
    its lock) run with `_cond` released, since the manager calls `put` holding its lock.
    """

    def __init__(self, agent: str, ctx: WriterContext) -> None:
        self.agent = agent
        self.state = PeerState.ACTIVE
        self._ctx = ctx
        self._cond = threading.Condition()
        self._queue: deque[WriteJob] = deque()
        self._flights: list[_Flight] = []
        self._orphans = 0  # flights failed already and still running (no probe until 0)
        self._fenced_at = 0.0
        self._why = ""  # why it is fenced
        self._busy_since = 0.0  # a backend call of this lane's thread is running since then
        self._closed = False
        self._rng = random.Random()
        self._thread: threading.Thread | None = None

    # ---- any thread ---------------------------------------------------------------------------

    def put(self, job: WriteJob) -> bool:
        """Queue a job; False when the lane is full or closed (the caller fails the job)."""
        with self._cond:
            if self._closed or len(self._queue) >= MAX_QUEUED:
                return False
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"kv-lane-{self.agent}")
                self._thread.start()
            self._cond.notify()
            return True

    def refusal(self) -> str | None:
        """Why a new room to this peer is refused now (fenced, no probe due), else None."""
        with self._cond:
            if self.state is PeerState.ACTIVE or self._probe_due(time.monotonic()):
                return None
            return self._fence_msg()

    def check(self, now: float) -> None:
        """Supervisor: a backend call stuck past the deadline fences the peer (its queue fails
        now; the stuck thread handles its flights when the call returns)."""
        with self._cond:
            busy = self._busy_since
            if not busy or now - busy <= self._ctx.timeout_s or self.state is PeerState.FENCED:
                return
            queued = self._fence(f"a call to its transfer agent has not returned for "
                                 f"{now - busy:.1f}s", now)
        self._fail_jobs(queued, timed_out=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify()
            thread = self._thread
        self._fail_jobs(queued, timed_out=False, why="transfer manager closing")
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._ctx.timeout_s + 1)

    # ---- the lane's thread --------------------------------------------------------------------

    def _run(self) -> None:
        idle_since = time.monotonic()
        backoff = POLL_MIN_S
        while True:
            with self._cond:
                if self._closed:
                    break
                if not self._queue and not self._flights:
                    if time.monotonic() - idle_since > IDLE_EXIT_S:
                        self._thread = None  # `put` starts a new one
                        return
                    self._cond.wait(1.0)
                    continue
                take: list[WriteJob] = []
                refused: list[WriteJob] = []
                if self.state is PeerState.FENCED and not self._probe_due(time.monotonic()):
                    refused, take = list(self._queue), []  # fail now, whatever is in flight
                    self._queue.clear()
                busy = len(self._flights) - self._orphans  # orphans take no slot
                while self._queue and busy + len(take) < MAX_IN_FLIGHT:
                    take.append(self._queue.popleft())
            self._fail_jobs(refused, timed_out=True)
            for job in take:
                self._start(job)
            if self._advance():
                backoff = POLL_MIN_S
            elif self._flights:
                time.sleep(backoff)
                backoff = min(backoff * 2, POLL_MAX_S)
            idle_since = time.monotonic()
        for f in list(self._flights):  # closing: stop what can be stopped, forget the rest
            if f.handle is not None and not f.released:
                self._cancel(f)
            self._end(f, WriteFailure("transfer manager closing"))
        with self._cond:
            self._thread = None

    def _start(self, job: WriteJob) -> None:
        now = time.monotonic()
        if job.sender.state.finished:  # aborted while queued: do not touch decode memory
            self._report(job, WriteFailure("room ended before the write"))
            return
        with self._cond:
            refused = None
            if self.state is PeerState.FENCED and self._probe_due(now):
                self.state = PeerState.PROBING
                log.info("decode agent %s: probing it with one write", self.agent)
            elif self.state is not PeerState.ACTIVE:
                refused = self._fence_msg()  # fenced; or a probe is already out
        if refused is not None:
            self._report(job, WriteFailure(refused, timed_out=True))
            return
        faults = self._ctx.faults()
        fail, corrupt = faults.draw(self._rng) if faults.active else (False, False)
        ranges = [(r.src, r.length) for r in job.ranges]
        crc = crc_of(self._ctx.kv_ptr, ranges) if self._ctx.checksum and not fail else None
        flight = _Flight(job, now, crc, now + faults.delay_ms / 1e3, fail, corrupt)
        self._flights.append(flight)
        if not faults.delay_ms:
            self._submit(flight)

    def _submit(self, f: _Flight) -> None:
        if f.fail:
            self._end(f, WriteFailure(f"injected fault ({self._ctx.faults()})"))
            return
        ctx = self._ctx
        spans = [(ctx.kv_ptr + r.src, f.job.peer.kv_base + r.dst, r.length)
                 for r in split_ranges(f.job.ranges, ctx.backend.max_range_bytes)]
        self._busy_since = time.monotonic()
        try:
            f.handle = ctx.backend.submit(self.agent, spans)
        except BackendError as e:
            self._end(f, WriteFailure(str(e)))
        finally:
            self._busy_since = 0.0

    def _advance(self) -> bool:
        """Poll every flight once; True when one ended."""
        now, before = time.monotonic(), len(self._flights)
        for f in list(self._flights):
            if f.handle is None:  # held by the delay drill: it is on the wire, it will land
                if now >= f.submit_at:
                    self._submit(f)
                elif now - f.started > self._ctx.timeout_s and not f.reported:
                    self._timed_out(now)
                continue
            ended = f.job.sender.state.finished and not f.orphan and not f.released
            room = f.job.sender
            if ended and room.timed_out and room.fault is Side.DECODE and not f.reported:
                # The room's own deadline says this peer stopped answering (it fired before
                # the write's): fence it like an unconfirmed write would.
                self._timed_out(now)
                if f not in self._flights:
                    continue
                ended = False  # an orphan now: polled until it ends
            if ended and self._cancel(f):
                self._end(f, WriteFailure("room ended during the write"))
                continue
            try:
                status = self._ctx.backend.poll(f.handle)
            except BackendError as e:
                self._end(f, WriteFailure(str(e)))
                continue
            if status is WriteStatus.DONE:
                self._answered()
                self._end(f, self._corrupt(f) if f.corrupt and not f.reported else None)
            elif status is WriteStatus.FAILED:
                self._end(f, WriteFailure(f"{self._ctx.backend.name}: write of "
                                          f"{len(f.job.ranges)} ranges to {self.agent} failed"))
            elif now - f.started > self._ctx.timeout_s and not f.reported:
                self._timed_out(now)
        return len(self._flights) < before

    def _timed_out(self, now: float) -> None:
        """A write unconfirmed past the deadline: fence the peer; everything it holds fails."""
        with self._cond:
            queued = self._fence(f"a write to it was not confirmed within "
                                 f"transfer_timeout_s={self._ctx.timeout_s}s", now)
        self._fail_jobs(queued, timed_out=True)
        for f in list(self._flights):
            if f.reported:
                continue
            if f.handle is not None and not f.released and self._cancel(f):
                self._end(f, WriteFailure(self._fence_msg(), timed_out=True))
                continue
            f.reported, f.orphan = True, True  # held by the drill, or not stoppable
            self._orphans += 1
            self._ctx.on_result(f.job, WriteFailure(self._fence_msg(), timed_out=True), 0, None)

    def _fence(self, why: str, now: float) -> list[WriteJob]:
        """Enter FENCED (lock held); returns the queued jobs, which the caller fails."""
        if self.state is not PeerState.FENCED:
            log.warning("decode agent %s fenced: %s", self.agent, why)
        self.state, self._fenced_at, self._why = PeerState.FENCED, now, why
        queued = list(self._queue)
        self._queue.clear()
        return queued

    def _cancel(self, f: _Flight) -> bool:
        """Stop `f`'s write; False when the backend cannot (then it is polled as an orphan)."""
        try:
            f.released = self._ctx.backend.cancel(f.handle)
        except BackendError as e:
            log.warning("decode agent %s: cancelling a write failed: %s", self.agent, e)
        return f.released

    def _answered(self) -> None:
        with self._cond:
            if self.state is not PeerState.ACTIVE:
                log.warning("decode agent %s answers again: fence lifted", self.agent)
            self.state = PeerState.ACTIVE

    def _end(self, f: _Flight, failure: WriteFailure | None) -> None:
        """`f` is over: give its handle back, report it (once), count it settled."""
        self._flights.remove(f)
        if f.orphan:
            self._orphans -= 1
        if f.handle is not None and not f.released:
            try:
                self._ctx.backend.release(f.handle)
            except BackendError as e:
                log.warning("decode agent %s: releasing a write failed: %s", self.agent, e)
        if failure is not None and self.state is PeerState.PROBING:
            with self._cond:  # the probe failed: fenced again, for another interval
                self.state, self._fenced_at = PeerState.FENCED, time.monotonic()
        if not f.reported:
            nbytes = sum(r.length for r in f.job.ranges) if failure is None else 0
            self._ctx.on_result(f.job, failure, nbytes, f.crc)
        self._ctx.on_settled(f.job)

    def _corrupt(self, f: _Flight) -> WriteFailure | None:
        """corrupt= drill: after the real write, overwrite the start of every landed page with
        random bytes (up to CORRUPT_BYTES each), so the KV decode reads is garbage, for real."""
        job, page = f.job, self._ctx.page_bytes
        spans = [(self._ctx.scratch, job.peer.kv_base + r.dst + off,
                  min(CORRUPT_BYTES, r.length - off))
                 for r in job.ranges for off in range(0, r.length, page)]
        try:
            self._ctx.backend.write(self.agent, spans, self._ctx.timeout_s)
        except BackendError as e:
            return WriteFailure(str(e))
        return None

    def _report(self, job: WriteJob, failure: WriteFailure) -> None:
        """A job that never reached the backend: its result, and it is settled."""
        self._ctx.on_result(job, failure, 0, None)
        self._ctx.on_settled(job)

    def _fail_jobs(self, jobs: list[WriteJob], timed_out: bool, why: str = "") -> None:
        for job in jobs:
            self._report(job, WriteFailure(why or self._fence_msg(), timed_out))

    # ---- helpers (lock held) ------------------------------------------------------------------

    def _probe_due(self, now: float) -> bool:
        return (self.state is PeerState.FENCED and now - self._fenced_at >= self._ctx.timeout_s
                and self._orphans == 0)

    def _fence_msg(self) -> str:
        return (f"decode agent {self.agent} is fenced ({self._why}); writes to it fail until "
                "it answers again")


class Writer:
    """The lanes of one manager, by decode agent."""

    def __init__(self, ctx: WriterContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._lanes: dict[str, PeerLane] = {}
        self._closed = False

    def submit(self, job: WriteJob) -> None:
        """Queue `job` on its peer's lane; never blocks (a full lane fails the job at once)."""
        lane = self._lane(job.peer.agent_name)
        if lane is None or not lane.put(job):
            why = "transfer manager closing" if lane is None else (
                f"{MAX_QUEUED} writes already queued for decode agent {job.peer.agent_name}")
            threading.Thread(target=self._reject, args=(job, why), daemon=True).start()

    def refusal(self, agent: str) -> str | None:
        with self._lock:
            lane = self._lanes.get(agent)
        return lane.refusal() if lane is not None else None

    def check(self) -> None:
        now = time.monotonic()
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.check(now)

    def states(self) -> dict[str, PeerState]:
        with self._lock:
            return {a: lane.state for a, lane in self._lanes.items()}

    def forget(self, agent: str) -> None:
        """The peer restarted or left: its lane goes (its rooms were failed already)."""
        with self._lock:
            lane = self._lanes.pop(agent, None)
        if lane is not None:
            lane.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.close()

    def _lane(self, agent: str) -> PeerLane | None:
        with self._lock:
            if self._closed:
                return None
            lane = self._lanes.get(agent)
            if lane is None:
                lane = self._lanes[agent] = PeerLane(agent, self._ctx)
            return lane

    def _reject(self, job: WriteJob, why: str) -> None:
        """Fail a job that no lane took, off the caller's thread (it holds the manager lock)."""
        self._ctx.on_result(job, WriteFailure(why, timed_out=False), 0, None)
        self._ctx.on_settled(job)


def scratch_buffer() -> ctypes.Array[ctypes.c_char]:
    """Random source bytes of the corrupt drill (the manager registers them once)."""
    return ctypes.create_string_buffer(os.urandom(CORRUPT_BYTES), CORRUPT_BYTES)
