"""Decode side of a room: register pages with every prefill rank, wait for DONE, verify.

Lifecycle (one decode rank):
1. The engine reserved pages for the prompt (+1 for the first token) and creates the receiver
   (BOOTSTRAPPING); it opens one Register stream per prefill TP rank (bootstrap addresses).
2. Every prefill rank answers ACCEPTED with its contract (checked here too): WAITING_FOR_INPUT.
3. A TRANSFERRING event (prefill issued its last writes) moves to TRANSFERRING.
4. DONE from every prefill rank: checksums (if sent) are verified over the landed pages, then
   SUCCESS with the first token. FAILED/ABORTED from a prefill rank, a broken stream, a
   mismatch or a deadline ends the room; cancelling the streams tells prefill.
5. A room that ended any other way than SUCCESS may still have a prefill write in flight into
   its pages. The receiver asks every prefill rank to release the room (ReleaseRoom: abort,
   wait for in-flight writes) on a background thread; `quiesced` turns True when all have
   answered, or when transfer_timeout_s has passed (a prefill that cannot be reached). Only
   then may the engine reuse the pages.
"""

from __future__ import annotations

import ctypes
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from protocol import bootstrap_pb2 as pb
from protocol import bootstrap_pb2_grpc as pb_grpc
from transfer.config import TransferConfig
from transfer.contract import ContractError, KVLayout, LayoutContract
from transfer.plan import coalesce, plan_pages, plan_window_tail
from transfer.room import Room, RoomState, Side
from transfer.wire import contract_from_pb


def crc_of(base: int, ranges: list[tuple[int, int]]) -> int:
    """zlib.crc32 over (offset, length) runs of memory at `base`, in order, without copies."""
    crc = 0
    for off, n in ranges:
        crc = zlib.crc32(memoryview((ctypes.c_char * n).from_address(base + off)), crc)
    return crc


# Decode's TRANSFERRING deadline runs this much past prefill's: prefill enforces the transfer
# deadline and names the side at fault, so while it lives its verdict arrives first; decode's
# own deadline is the backstop for a prefill that died or froze.
TRANSFER_GRACE_S = 1.0


class KVReceiver(Room):
    """Decode's half of one room. Created by `KVTransferManager.create_receiver`."""

    side = Side.DECODE

    def _timeout_of(self, state: RoomState) -> float:
        grace = TRANSFER_GRACE_S if state is RoomState.TRANSFERRING else 0.0
        return super()._timeout_of(state) + grace

    def __init__(
        self, room: int, config: TransferConfig, lock: threading.RLock,
        on_finish: Callable[[Room], None],
        *, contract: LayoutContract, layout: KVLayout, kv_base: int, addrs: list[str],
        registration: pb.RoomRegistration, channel_of: Callable[[str], grpc.Channel],
        release: Callable[[Callable[[], None]], Future[None]],
    ) -> None:
        super().__init__(room, config, lock, on_finish)
        self._contract = contract
        self._layout = layout
        self._kv_base = kv_base
        self._reg = registration
        self._addrs = addrs
        self._accepted: dict[int, LayoutContract] = {}  # stream index -> prefill contract
        self._done: dict[int, pb.RoomEvent] = {}
        self._calls: list[grpc.Future | None] = [None] * len(addrs)
        self._channel_of = channel_of
        self._release = release  # runs a callable off the engine's thread (the manager's pool)
        self._released = threading.Event()  # every prefill rank confirmed: no write in flight
        self._quarantine_until = float("inf")  # set when the room ends other than SUCCESS
        self._t0 = time.monotonic()
        self.first_token: int | None = None
        self.first_logprob: float | None = None
        self.top_logprobs: list[tuple[int, float]] = []
        # speculative eagle/mtp: the draft head's feature at the prompt's last position (one
        # prefill rank sends it); None when no DONE carried one
        self.draft_hidden: list[float] | None = None
        for i, addr in enumerate(addrs):
            self._open(i, addr)

    def _open(self, i: int, addr: str) -> None:
        stub = pb_grpc.BootstrapStub(self._channel_of(addr))
        threading.Thread(target=self._listen, args=(i, addr, stub), daemon=True,
                         name=f"kv-recv-{self.room:x}-{i}").start()

    def _add_prefill_ranks(self, addr: str, theirs: LayoutContract,
                           rank_addrs: list[str]) -> str | None:
        """Match our bootstrap addresses to prefill's TP ranks; open the missing streams
        (lock held).

        Returns an error, or None. One address given + prefill TP > 1: the ranks' addresses come
        from rank `theirs.tp_rank`'s ACCEPTED event.
        """
        if len(self._addrs) == theirs.tp_size:
            return None
        if len(self._addrs) != 1 or len(rank_addrs) != theirs.tp_size:
            return (f"prefill {addr} runs TP={theirs.tp_size}, but the room has "
                    f"{len(self._addrs)} bootstrap address(es) and prefill published "
                    f"{len(rank_addrs)}; give every rank's address comma-separated, or have "
                    "prefill call set_tp_bootstrap_addrs")
        for rank, other in enumerate(rank_addrs):
            if rank != theirs.tp_rank:
                self._addrs.append(other)
                self._calls.append(None)
                self._open(len(self._addrs) - 1, other)
        return None

    def _listen(self, i: int, addr: str, stub: pb_grpc.BootstrapStub) -> None:
        """Read one prefill rank's events (runs on its own thread)."""
        call = stub.Register(self._reg)
        with self._lock:
            self._calls[i] = call
            if self._state.finished:
                call.cancel()
        try:
            for ev in call:
                self._on_event(i, addr, ev)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            with self._lock:
                if not self._state.finished:
                    # ABORTED: prefill ended the room before we registered (e.g. the client left).
                    state = (RoomState.ABORTED if code == grpc.StatusCode.ABORTED
                             else RoomState.FAILED)
                    details = e.details()  # type: ignore[attr-defined]
                    self._finish(state, f"bootstrap stream to prefill {addr} ended: "
                                 f"{code.name}: {details}", fault=Side.PREFILL)
            return
        with self._lock:
            if not self._state.finished and i not in self._done:
                self._finish(RoomState.FAILED, f"bootstrap stream to prefill {addr} closed "
                             "without DONE", fault=Side.PREFILL)

    def _on_event(self, i: int, addr: str, ev: pb.RoomEvent) -> None:
        with self._lock:
            if self._state.finished:
                return
            if ev.kind == pb.RoomEvent.ACCEPTED:
                theirs = contract_from_pb(ev.contract)
                diffs = self._contract.mismatches(theirs)
                if diffs:
                    self._finish(RoomState.FAILED, f"prefill {addr} contract differs: "
                                 + "; ".join(diffs), fault=Side.PREFILL)
                    return
                err = self._add_prefill_ranks(addr, theirs, list(ev.rank_addrs))
                if err:
                    self._finish(RoomState.FAILED, err, fault=Side.PREFILL)
                    return
                self._accepted[i] = theirs
                if (len(self._accepted) == len(self._addrs)
                        and self._state is RoomState.BOOTSTRAPPING):
                    self._enter(RoomState.WAITING_FOR_INPUT)
            elif ev.kind == pb.RoomEvent.TRANSFERRING:
                if self._state is not RoomState.TRANSFERRING:
                    self._enter(RoomState.TRANSFERRING)
            elif ev.kind == pb.RoomEvent.DONE:
                self._done[i] = ev
                if len(self._done) == len(self._addrs):
                    self._complete()
            else:  # FAILED / ABORTED: blame whom prefill blamed (itself when it does not say)
                fault = Side.DECODE if ev.fault == Side.DECODE.value else Side.PREFILL
                aborted = ev.kind == pb.RoomEvent.ABORTED
                self._finish(RoomState.ABORTED if aborted else RoomState.FAILED,
                             f"prefill {addr} {'aborted' if aborted else 'failed'} the room: "
                             f"{ev.reason}", fault=fault, timed_out=ev.timed_out)

    def _complete(self) -> None:
        """Every prefill rank confirmed: verify checksums, take the first token (lock held)."""
        for i, ev in sorted(self._done.items()):
            err = self._verify(self._accepted[i], ev)
            if err:
                self._finish(RoomState.FAILED, f"room {self.room:#x}: KV checksum mismatch from "
                             f"prefill {self._addrs[i]}: {err}", fault=Side.PREFILL)
                return
            self.stats.pages += ev.pages
            self.stats.bytes += ev.bytes
        first = self._done[min(self._done)]  # TP ranks sample the same token; rank order is stable
        self.first_token = first.first_token if first.first_token >= 0 else None
        self.first_logprob = first.first_logprob
        self.top_logprobs = [(t.token_id, t.logprob) for t in first.top_logprobs]
        self.draft_hidden = next((list(ev.draft_hidden) for _, ev in sorted(self._done.items())
                                  if ev.draft_hidden), None)
        self.stats.duration_ms = (time.monotonic() - self._t0) * 1e3
        self._finish(RoomState.SUCCESS, None)

    def _verify(self, theirs: LayoutContract, ev: pb.RoomEvent) -> str | None:
        """Recompute each page group's crc over our landed bytes, in the sender's plan order."""
        # Page ids index the peer's pool; only our (dst) offsets matter here.
        src = theirs.layout(num_pages=1 << 40,
                            num_window_pages=(1 << 40) if self._layout.num_window_pages else 0)
        dst_pages = list(self._reg.dst_pages)
        ring = list(self._reg.window_dst_pages)
        for g in ev.checksums:
            if g.state:  # the room's recurrent-state slot: one range
                group = self._layout.state_group
                if group is None or not self._reg.HasField("state_dst_slot"):
                    return "a state checksum arrived for a room with no state slot"
                dst = self._layout.state_offset(self._reg.state_dst_slot)
                got = crc_of(self._kv_base, [(dst, group.state_bytes)])
                if got != g.crc32:
                    return f"state slot crc {got:#010x} != sent {g.crc32:#010x}"
                continue
            if g.window:  # one page of the window ring, at ring index start_page
                ranges = plan_window_tail(src, self._layout, list(range(len(ring))), ring,
                                          [g.start_page])[0]
            else:
                dummy_src = list(range(g.num_pages))  # src offsets are irrelevant on this side
                ranges = plan_pages(src, self._layout, dummy_src, dst_pages,
                                    start_page=g.start_page, skip_pages=self._reg.skip_pages)
            ranges = coalesce(ranges)
            got = crc_of(self._kv_base, [(r.dst, r.length) for r in ranges])
            if got != g.crc32:
                return (f"pages [{g.start_page}, {g.start_page + g.num_pages}) "
                        f"crc {got:#010x} != sent {g.crc32:#010x}")
        return None

    def _on_terminal(self, state: RoomState, reason: str | None) -> None:
        if state is RoomState.SUCCESS:
            self._released.set()  # DONE came after every write was confirmed
            return
        for call in self._calls:
            if call is not None:
                call.cancel()  # prefill sees the stream end and aborts its side
        self._quarantine_until = time.monotonic() + self._config.transfer_timeout_s
        addrs = list(self._addrs)
        self._release(lambda: self._release_all(addrs, reason or state.value))

    @property
    def quiesced(self) -> bool:
        """True once no prefill write can land in this room's pages any more: the room succeeded,
        every prefill rank confirmed ReleaseRoom, or the bounded quarantine (transfer_timeout_s
        after the room ended) ran out. False while the room is live."""
        return self._released.is_set() or time.monotonic() >= self._quarantine_until

    def _release_all(self, addrs: list[str], reason: str) -> None:
        """ReleaseRoom on every prefill rank (on the manager's release pool). A rank that cannot
        be reached leaves the pages to the quarantine deadline instead."""
        msg = pb.RoomRelease(room=self.room, peer_id=self._reg.peer_id, reason=reason[:200])
        timeout = self._config.transfer_timeout_s + 1.0  # prefill waits up to transfer_timeout_s
        for addr in addrs:
            try:
                ack = pb_grpc.BootstrapStub(self._channel_of(addr)).ReleaseRoom(
                    msg, timeout=timeout)
            except grpc.RpcError:
                return  # unreachable or dead: the quarantine deadline frees the pages
            if not ack.drained:
                return  # a write was still in flight at prefill's deadline: wait out the quarantine
        self._released.set()


__all__ = ["KVReceiver", "ContractError", "crc_of"]
