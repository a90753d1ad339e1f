"""Prefill side of a room: pages in, writes out, a DONE event per decode rank at the end.

Lifecycle (one prefill rank):
1. The engine creates the sender when its Generate arrives (BOOTSTRAPPING). Decode's
   registration may already be waiting in the bootstrap service, or arrive later.
2. Every decode rank of the room registers (decode TP may differ from ours); once all have,
   the room is WAITING_FOR_INPUT and queued pages are planned and handed to the transfer thread.
3. `send(..., last=False)` ships prompt chunks as they complete; `send(..., last=True)` carries
   the first token and moves to TRANSFERRING.
4. When every write is confirmed the room is SUCCESS and each decode rank gets DONE (first
   token, counters, checksums). Any failure, abort or deadline sends FAILED/ABORTED instead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import bootstrap_pb2 as pb
from transfer.config import TransferConfig
from transfer.contract import KVLayout
from transfer.plan import Range, coalesce, plan_pages, plan_window_tail, window_tail_pages
from transfer.room import Room, RoomState, Side


class RoomEndedError(ValueError):
    """A registration arrived for a room that already ended here (aborted, failed or done)."""


@dataclass
class Peer:
    """One decode rank registered for this room; its bootstrap stream drains `events`."""

    tp_rank: int
    tp_size: int
    peer_id: str
    epoch: int
    agent_name: str
    kv_base: int
    layout: KVLayout  # the decode rank's layout (num_pages from its registered size)
    dst_pages: list[int]
    skip_pages: int
    window_dst_pages: list[int] = field(default_factory=list)  # the room's window ring on decode
    state_dst_slot: int = -1  # the room's recurrent-state slot on decode (-1: no state group)
    events: queue.Queue[pb.RoomEvent] = field(default_factory=queue.Queue)
    pages: int = 0
    bytes: int = 0
    checksums: list[pb.PageGroupChecksum] = field(default_factory=list)


@dataclass(frozen=True)
class WriteFailure:
    """Why a write failed; the decode peer is always the side at fault (it is the target)."""

    reason: str
    timed_out: bool = False  # unconfirmed past the deadline, or its peer is fenced for that


@dataclass
class WriteJob:
    """One backend batch for the transfer thread: this sender's chunk to one peer."""

    sender: KVSender
    peer: Peer
    ranges: list[Range]  # offsets from our base (src) and the peer's base (dst)
    start_page: int  # request page position of the chunk's first page (ring index if `window`)
    num_pages: int  # page positions the chunk writes to this peer
    window: bool = False  # one page of the window ring (its retained tail), not full pages
    state: bool = False  # the room's recurrent-state slot (the state group's replay tail)


@dataclass
class _Chunk:
    src_pages: list[int]  # full pages; or, for a window tail, our whole window ring
    start_page: int
    ring_indices: list[int] | None = None  # window tail: the ring pages to ship
    state_slot: int = -1  # the state after the prompt: our slot to ship (src_pages empty)


class KVSender(Room):
    """Prefill's half of one room. Created by `KVTransferManager.create_sender`."""

    side = Side.PREFILL

    def __init__(
        self, room: int, config: TransferConfig, lock: threading.RLock,
        on_finish: Callable[[Room], None], layout: KVLayout, submit: Callable[[WriteJob], None],
    ) -> None:
        super().__init__(room, config, lock, on_finish)
        self._layout = layout
        self._submit = submit
        self.peers: dict[int, Peer] = {}
        self._expected_peers = 0  # decode tp_size, known at the first registration
        self._chunks: list[_Chunk] = []  # pages sent before every decode rank registered
        self._last = False
        self._in_flight = 0
        self._first_write_t = 0.0
        self.first_token: int | None = None
        self.first_logprob: float | None = None
        self.top_logprobs: list[tuple[int, float]] = []
        self.draft_hidden: list[float] = []  # speculative eagle/mtp: the head's last feature

    # ---- engine-facing ----------------------------------------------------------------

    def send(
        self, src_pages: list[int], *, start_page: int, last: bool, first_token: int | None = None,
        first_logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None,
        window_ring: list[int] | None = None, num_tokens: int = 0, state_slot: int = -1,
        draft_hidden: list[float] | None = None,
    ) -> None:
        """Ship `src_pages` (request positions start_page...) to decode; never blocks.

        `draft_hidden` (last send, speculative eagle/mtp): the draft head's feature at the
        prompt's last position, sent on DONE beside the first token.

        With `last=True` on a layout with a window region, `window_ring` (our ring, in ring
        order) and `num_tokens` (tokens computed) add the ring's retained tail: the pages of its
        last `window` tokens, landed in decode's ring at the same ring indices. On a layout with
        a recurrent group, `state_slot` (ours, holding the state after the prompt) adds the
        state: one range into the room's slot on decode.
        A no-op on a finished room (its terminal state is what `poll` reports).
        """
        with self._lock:
            if self._state.finished:
                return
            if self._last:
                raise RuntimeError(f"room {self.room:#x}: send() after send(last=True)")
            if last:
                self._last = True
                self.first_token, self.first_logprob = first_token, first_logprob
                self.top_logprobs = list(top_logprobs or [])
                self.draft_hidden = list(draft_hidden or [])
            if src_pages:
                self._chunks.append(_Chunk(list(src_pages), start_page))
            group = self._layout.window_group
            if last and group is not None:
                if window_ring is None or num_tokens <= 0:
                    raise ValueError(f"room {self.room:#x}: the layout has a window region; the "
                                     "last send needs window_ring and num_tokens (the ring's "
                                     "tail is part of the KV)")
                tail = window_tail_pages(num_tokens, group.window, self._layout.page_size,
                                         len(window_ring))
                self._chunks.append(_Chunk(list(window_ring), 0, tail))
            if last and self._layout.state_group is not None:
                if state_slot < 0:
                    raise ValueError(f"room {self.room:#x}: the layout has a recurrent group; the "
                                     "last send needs state_slot (the state is part of the KV)")
                self._chunks.append(_Chunk([], 0, state_slot=state_slot))
            if self._paired():
                self._flush()
                if last:
                    self._enter(RoomState.TRANSFERRING)
                    for peer in self.peers.values():
                        peer.events.put(pb.RoomEvent(kind=pb.RoomEvent.TRANSFERRING))
                    self._maybe_done()

    # ---- bootstrap-facing (gRPC threads) ------------------------------------------------

    def attach(self, peer: Peer) -> None:
        """Add a decode rank's registration; raises ValueError if it does not fit the room."""
        with self._lock:
            if self._state.finished:
                raise RoomEndedError(f"room {self.room:#x} already ended on prefill "
                                     f"({self._state.value}: {self.error})")
            if self._expected_peers and peer.tp_size != self._expected_peers:
                raise ValueError(f"room {self.room:#x}: decode tp_size {peer.tp_size} != "
                                 f"{self._expected_peers} of earlier ranks")
            if peer.tp_rank in self.peers:
                raise ValueError(f"room {self.room:#x}: decode tp_rank {peer.tp_rank} "
                                 "registered twice")
            self._expected_peers = peer.tp_size
            self.peers[peer.tp_rank] = peer
            if not self._paired():
                return
            self._flush()
            if self._last:
                self._enter(RoomState.TRANSFERRING)
                for p in self.peers.values():
                    p.events.put(pb.RoomEvent(kind=pb.RoomEvent.TRANSFERRING))
                self._maybe_done()
            else:
                self._enter(RoomState.WAITING_FOR_INPUT)

    def hold(self) -> bool:
        """Decode has this room's request but no memory for it yet: restart the bootstrapping
        deadline (HoldRoom). False once the room has left BOOTSTRAPPING."""
        with self._lock:
            if self._state is not RoomState.BOOTSTRAPPING:
                return False
            self._deadline = time.monotonic() + self._config.bootstrap_timeout_s
            return True

    def peer_gone(self, peer: Peer, why: str) -> None:
        """The decode rank's stream ended before the room did: abort (decode cancelled or died)."""
        with self._lock:
            if self.peers.get(peer.tp_rank) is peer:
                self._finish(RoomState.ABORTED, f"decode rank {peer.tp_rank} ({peer.peer_id}) "
                             f"{why}", fault=Side.DECODE)

    def fail(self, reason: str, fault: Side = Side.DECODE, timed_out: bool = False) -> None:
        """Fail the room; by default the decode side is at fault (its peer restarted, its agent
        is unreachable or fenced)."""
        with self._lock:
            self._finish(RoomState.FAILED, reason, fault=fault, timed_out=timed_out)

    # ---- transfer-thread-facing ---------------------------------------------------------

    def write_done(self, job: WriteJob, failure: WriteFailure | None, nbytes: int,
                   crc: int | None) -> None:
        """A write's result (once per job, from its lane). A failure fails the room, blaming
        the decode peer it was written to."""
        with self._lock:
            self._in_flight -= 1
            if self._state.finished:
                return
            if failure is not None:
                self._finish(RoomState.FAILED, f"room {self.room:#x}: write to decode rank "
                             f"{job.peer.tp_rank} ({job.peer.peer_id}) failed: {failure.reason}",
                             fault=Side.DECODE, timed_out=failure.timed_out)
                return
            job.peer.pages += job.num_pages
            job.peer.bytes += nbytes
            self.stats.pages += job.num_pages
            self.stats.bytes += nbytes
            self.stats.writes += 1
            if crc is not None:
                job.peer.checksums.append(pb.PageGroupChecksum(
                    start_page=job.start_page, num_pages=job.num_pages, crc32=crc,
                    window=job.window, state=job.state))
            self._maybe_done()

    # ---- internals (lock held) ----------------------------------------------------------

    def _paired(self) -> bool:
        return self._expected_peers > 0 and len(self.peers) == self._expected_peers

    def _flush(self) -> None:
        """Plan queued chunks for every decode rank and hand them to the transfer thread."""
        for chunk in self._chunks:
            if chunk.ring_indices is not None:
                self._flush_tail(chunk.src_pages, chunk.ring_indices)
                continue
            if chunk.state_slot >= 0:
                self._flush_state(chunk.state_slot)
                continue
            for peer in self.peers.values():
                ranges = plan_pages(self._layout, peer.layout, chunk.src_pages, peer.dst_pages,
                                    start_page=chunk.start_page, skip_pages=peer.skip_pages)
                if not ranges:
                    continue  # decode already has these pages, or no head of ours goes to this rank
                covered = (chunk.start_page + len(chunk.src_pages)
                           - max(chunk.start_page, peer.skip_pages))
                if not self._first_write_t:
                    self._first_write_t = time.monotonic()
                self._in_flight += 1
                self._submit(WriteJob(self, peer, ranges, max(chunk.start_page, peer.skip_pages),
                                      covered))
        self._chunks.clear()

    def _flush_tail(self, ring: list[int], ring_indices: list[int]) -> None:
        """One write job per (peer, ring page) of the window tail (lock held)."""
        for peer in self.peers.values():
            per_page = plan_window_tail(self._layout, peer.layout, ring, peer.window_dst_pages,
                                        ring_indices)
            for idx, ranges in zip(ring_indices, per_page, strict=True):
                if not ranges:
                    continue  # no head of ours goes to this rank
                if not self._first_write_t:
                    self._first_write_t = time.monotonic()
                self._in_flight += 1
                self._submit(WriteJob(self, peer, coalesce(ranges), idx, 1, window=True))

    def _flush_state(self, slot: int) -> None:
        """The state slot to every decode rank that has one (lock held): one range each."""
        group = self._layout.state_group
        assert group is not None
        for peer in self.peers.values():
            if peer.state_dst_slot < 0:
                continue
            src = self._layout.state_offset(slot)
            dst = peer.layout.state_offset(peer.state_dst_slot)
            if not self._first_write_t:
                self._first_write_t = time.monotonic()
            self._in_flight += 1
            self._submit(WriteJob(self, peer, [Range(src, dst, group.state_bytes)], 0, 0,
                                  state=True))

    def _maybe_done(self) -> None:
        if not (self._last and self._paired() and self._in_flight == 0 and not self._chunks):
            return
        if self._first_write_t:
            self.stats.duration_ms = (time.monotonic() - self._first_write_t) * 1e3
        for peer in self.peers.values():
            peer.events.put(pb.RoomEvent(
                kind=pb.RoomEvent.DONE,
                first_token=-1 if self.first_token is None else self.first_token,
                first_logprob=self.first_logprob or 0.0,
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in self.top_logprobs],
                checksums=peer.checksums, pages=peer.pages, bytes=peer.bytes,
                duration_ms=self.stats.duration_ms,
                draft_hidden=self.draft_hidden,
            ))
        self._finish(RoomState.SUCCESS, None)

    def _late_side(self, state: RoomState) -> Side:
        # Waiting for input, the prompt is ours to compute; otherwise decode is late (it never
        # registered, or its memory does not confirm our writes).
        return Side.PREFILL if state is RoomState.WAITING_FOR_INPUT else Side.DECODE

    def _on_terminal(self, state: RoomState, reason: str | None) -> None:
        if state is RoomState.SUCCESS:
            return
        kind = pb.RoomEvent.ABORTED if state is RoomState.ABORTED else pb.RoomEvent.FAILED
        fault = self.fault.value if self.fault is not None else ""
        for peer in self.peers.values():
            peer.events.put(pb.RoomEvent(kind=kind, reason=reason or "", fault=fault,
                                         timed_out=self.timed_out))
