"""KVTransferManager: one per worker rank; owns the backend, the rooms and the write lanes.

The engine's thread only calls non-blocking methods (create_*, send, poll, abort,
take_finished). Everything else runs elsewhere: backend writes on one lane per decode agent
(transfer/lanes.py: writes to different peers never wait on each other, and a peer that stops
answering is fenced), bootstrap streams on the gRPC server's threads (prefill) or on one thread
per open stream (decode).
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from protocol import bootstrap_pb2 as pb
from protocol import bootstrap_pb2_grpc as pb_grpc
from protocol.bootstrap_addr import room_ranks
from protocol.tls import TLSConfig, add_port
from protocol.tls import channel as tls_channel
from transfer.backend import TransferBackend, TransferFaults
from transfer.bootstrap import BootstrapService
from transfer.config import TransferConfig, TransferConfigError
from transfer.contract import ContractError, KVLayout, LayoutContract
from transfer.factory import make_backend
from transfer.holds import RoomHolds
from transfer.lanes import CORRUPT_BYTES, PeerState, Writer, WriterContext, scratch_buffer
from transfer.receiver import KVReceiver
from transfer.room import (
    NoBootstrapAddrError,
    Room,
    RoomExistsError,
    RoomState,
    TransferTotals,
)
from transfer.sender import KVSender, Peer, WriteFailure, WriteJob
from transfer.wire import contract_from_pb, contract_to_pb

# decode: ReleaseRoom calls at once (each is short; an unreachable prefill fails fast)
RELEASE_THREADS = 4
MAX_LIVE_ROOMS = 1024  # prefill: bootstrap registrations served at once (one thread each)


class KVTransferManager:
    """Moves KV pages of one rank to (prefill) or from (decode) peer ranks, room by room."""

    def __init__(
        self, config: TransferConfig, layout: KVLayout, *, role: str, kv_ptr: int, kv_nbytes: int,
        host: str, model_fingerprint: str, model_name: str = "", peer_id: str = "",
        faults: TransferFaults | None = None, backend: TransferBackend | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        config.validate()
        if role not in ("prefill", "decode"):
            raise TransferConfigError(
                f"KVTransferManager role must be 'prefill' or 'decode', got {role!r}"
            )
        if kv_nbytes < layout.pool_bytes:
            raise ContractError(
                f"kv_nbytes={kv_nbytes} is smaller than the layout's pool ({layout.num_pages} "
                f"pages x {layout.page_bytes} B); describe the tensor you register"
            )
        self.config = config
        self.tls = tls or TLSConfig()  # bootstrap calls to prefill ranks
        self.layout = layout
        self.role = role
        self.epoch: int = secrets.randbits(64) or 1  # a new incarnation at every start
        self.kv_ptr, self.kv_nbytes = kv_ptr, kv_nbytes
        self.contract = LayoutContract.from_layout(layout, model_name=model_name,
                                                   model_fingerprint=model_fingerprint,
                                                   backend=config.backend)
        self.faults = faults if faults is not None else TransferFaults.from_env()
        adv = config.advertise_host or host
        label = f"tandem-{role}-{adv}-tp{layout.tp_rank}-{self.epoch:016x}"
        self.backend = backend or make_backend(config, adv, label, bind_host=host)
        self.backend.register(kv_ptr, kv_nbytes)
        # peer_id names this rank across restarts (the worker passes its gRPC address).
        self.peer_id = f"{peer_id or self.backend.agent_name}/tp{layout.tp_rank}"
        # Source of the corrupt= drill's garbage; registered always, since drills can be
        # switched on at run time (`manager.faults = ...`).
        self._scratch = scratch_buffer()
        if role == "prefill":
            self.backend.register(ctypes.addressof(self._scratch), CORRUPT_BYTES)
        self._lock = threading.RLock()
        self._room_added = threading.Condition(self._lock)
        self._rooms: dict[int, Room] = {}
        self._finished: deque[Room] = deque()
        self._totals = TransferTotals()
        self._channels: dict[str, grpc.Channel] = {}
        self._agent_epoch: dict[str, tuple[str, int]] = {}  # decode agent -> (peer_id, epoch)
        # prefill: bootstrap address of every TP rank (set_tp_bootstrap_addrs)
        self._tp_addrs: list[str] = []
        # prefill: write jobs submitted and not yet done, per room (ReleaseRoom waits for 0);
        # rooms decode released (room -> expiry): a later registration or sender is refused.
        self._jobs_of: dict[int, int] = {}
        self._job_done = threading.Condition(self._lock)
        self._released: dict[int, float] = {}
        # decode: ReleaseRoom and HoldRoom calls run here, never on the engine's thread.
        self._release_pool = ThreadPoolExecutor(
            max_workers=RELEASE_THREADS, thread_name_prefix=f"kv-release-{role}"
        )
        self._holds = RoomHolds(peer_id=self.peer_id, epoch=self.epoch,
                                timeout_s=config.bootstrap_timeout_s / 3, channel_of=self._channel,
                                submit=self._release_pool.submit)
        self._writer = Writer(WriterContext(
            backend=self.backend, kv_ptr=kv_ptr, page_bytes=layout.page_bytes,
            scratch=ctypes.addressof(self._scratch), checksum=config.checksum,
            timeout_s=config.transfer_timeout_s, faults=lambda: self.faults,
            on_result=self._write_result, on_settled=self._write_settled))
        self._closed = False

    # ---- prefill ------------------------------------------------------------------------

    def add_to_server(self, server: grpc.Server) -> None:
        """Serve the bootstrap service on the worker's gRPC server (prefill ranks)."""
        if self.role != "prefill":
            raise TransferConfigError(
                "add_to_server is for prefill ranks; decode ranks register, they do not serve"
            )
        service = BootstrapService(
            self.config, self.contract, self._lock, wait_sender=self._wait_sender,
            connect_peer=self._connect_peer, peer_restarted=self._peer_restarted,
            rank_addrs=lambda: list(self._tp_addrs), release_room=self.release_room,
            hold_room=self._hold_room, peer_refusal=self._writer.refusal)
        pb_grpc.add_BootstrapServicer_to_server(service, server)

    def serve_bootstrap(self, host: str, port: int) -> tuple[grpc.Server, int]:
        """Prefill: serve the bootstrap service on its own thread-pool server at host:port
        (0 = any free port); returns the started server and its port.

        Its own server because a registration stream lives as long as its room and blocks a
        thread, which must never be the worker's event loop.
        """
        pool = ThreadPoolExecutor(max_workers=MAX_LIVE_ROOMS, thread_name_prefix="bootstrap")
        # gRPC sets SO_REUSEPORT by default: a second prefill pinned to this port would bind
        # it too, and the kernel would split decode's registrations between the two.
        server = grpc.server(pool, options=[("grpc.so_reuseport", 0)])
        self.add_to_server(server)
        try:
            bound = add_port(server, f"{host}:{port}", self.tls)
        except RuntimeError:  # grpc raises on a failed bind; older versions returned 0
            bound = 0
        if bound == 0:
            raise TransferConfigError(f"cannot bind the bootstrap service on {host}:{port}: the "
                                      "port is in use (another prefill worker?); set "
                                      "transfer.bootstrap_port to a free port (0: any)")
        server.start()
        return server, bound

    def set_tp_bootstrap_addrs(self, addrs: list[str]) -> None:
        """Prefill with TP > 1: every rank's bootstrap address, in rank order.

        Published in ACCEPTED, so decode needs only one of them (the gateway's bootstrap_addr)
        and registers with the other ranks itself.
        """
        if len(addrs) != self.layout.tp_size:
            raise TransferConfigError(
                f"set_tp_bootstrap_addrs: got {len(addrs)} addresses for "
                f"tp_size={self.layout.tp_size}; give one host:port per prefill rank, in rank order"
            )
        self._tp_addrs = list(addrs)

    def create_sender(self, room: int) -> KVSender:
        with self._lock:
            self._check_new(room, "prefill")
            sender = KVSender(
                room, self.config, self._lock, self._room_finished, self.layout, self._submit
            )
            self._rooms[room] = sender
            if room in self._released:  # decode gave this room up before our Generate arrived
                sender.abort(f"room {room:#x} was released by decode before prefill started it")
            self._room_added.notify_all()
            return sender

    def _submit(self, job: WriteJob) -> None:
        """Queue a write on its peer's lane, counted per room (lock held by the sender)."""
        self._jobs_of[job.sender.room] = self._jobs_of.get(job.sender.room, 0) + 1
        self._writer.submit(job)

    def _write_result(self, job: WriteJob, failure: WriteFailure | None, nbytes: int,
                      crc: int | None) -> None:
        job.sender.write_done(job, failure, nbytes, crc)

    def _write_settled(self, job: WriteJob) -> None:
        """Nothing of `job` can land any more: a ReleaseRoom waiting on its room may answer."""
        with self._lock:
            room = job.sender.room
            self._jobs_of[room] -= 1
            if not self._jobs_of[room]:
                del self._jobs_of[room]
            self._job_done.notify_all()

    def peer_states(self) -> dict[str, PeerState]:
        """Prefill: how each decode agent written to is treated (fenced ones take no writes)."""
        return self._writer.states()

    def release_room(self, room: int, reason: str, timeout_s: float) -> tuple[bool, float]:
        """Prefill: decode gives `room` up. Abort our side, refuse later registrations for it,
        and wait (at most `timeout_s`) until none of its writes is in flight.

        Returns (drained, seconds waited). Runs on a bootstrap thread, never the engine's.
        """
        t0 = time.monotonic()
        with self._lock:
            now = time.monotonic()
            self._released[room] = now + self._tombstone_s()
            while self._released and next(iter(self._released.values())) < now:  # oldest first
                del self._released[next(iter(self._released))]
            sender = self._rooms.get(room)
            if isinstance(sender, KVSender):
                sender.abort(f"decode released the room: {reason}")
            self._room_added.notify_all()  # a Register waiting for this room stops waiting
            drained = self._job_done.wait_for(lambda: not self._jobs_of.get(room), timeout_s)
        return drained, time.monotonic() - t0

    def _tombstone_s(self) -> float:
        """How long a released room stays refused: past any registration or Generate
        still in flight."""
        c = self.config
        return 2 * (c.bootstrap_timeout_s + c.waiting_timeout_s)

    def _hold_room(self, room: int) -> bool:
        r = self.get(room)
        return isinstance(r, KVSender) and r.hold()

    def _wait_sender(self, room: int, timeout_s: float) -> KVSender | None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                r = self._rooms.get(room)
                if isinstance(r, KVSender):
                    return r
                if room in self._released:
                    return None
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._room_added.wait(left)

    def _connect_peer(self, reg: pb.RoomRegistration) -> Peer:
        """Turn a registration into a Peer (checks its pages against its pool);
        connects the backend."""
        theirs = contract_from_pb(reg.contract)
        shape = theirs.layout(num_window_pages=reg.num_window_pages)
        window_bytes = shape.window_view().pool_bytes if reg.num_window_pages else 0
        pages_end = reg.state_base if reg.num_state_slots else reg.kv_nbytes  # state comes last
        # A model whose layers all keep recurrent state (a Qwen3-Next of linear_attention layers
        # only) has pages of no bytes, so their count is not in the registered memory; its page
        # ids address no bytes: the pool is taken to hold every page named.
        num_pages = ((pages_end - window_bytes) // shape.page_bytes if shape.page_bytes
                     else max(reg.dst_pages, default=0) + 1)
        bad = [p for p in reg.dst_pages if not 0 <= p < num_pages]
        if bad:
            raise ValueError(
                f"room {reg.room:#x}: dst_pages {bad[:4]} "
                f"outside decode's pool of {num_pages} pages"
            )
        bad = [p for p in reg.window_dst_pages if not 0 <= p < reg.num_window_pages]
        if bad:
            raise ValueError(
                f"room {reg.room:#x}: window_dst_pages {bad[:4]} outside decode's window region of "
                f"{reg.num_window_pages} pages"
            )
        layout = theirs.layout(num_pages, reg.num_window_pages, reg.num_state_slots, reg.state_base)
        state_slot = reg.state_dst_slot if reg.HasField("state_dst_slot") else -1
        if (state_slot >= 0) != (self.layout.state_group is not None):
            raise ValueError(f"room {reg.room:#x}: state_dst_slot {state_slot} but this prefill "
                             f"rank's layout {'has' if self.layout.state_group else 'has no'} "
                             "recurrent state: both sides must serve the same model")
        if state_slot >= 0:
            end = layout.state_offset(state_slot) + layout.state_group.state_bytes  # type: ignore[union-attr]
            if end > reg.kv_nbytes:
                raise ValueError(f"room {reg.room:#x}: state slot {state_slot} ends past decode's "
                                 f"registered memory ({end} > {reg.kv_nbytes} bytes)")
        with self._lock:
            self._agent_epoch[reg.agent_name] = (reg.peer_id, reg.epoch)
        self.backend.connect(reg.agent_name, reg.agent_metadata)
        return Peer(tp_rank=theirs.tp_rank, tp_size=theirs.tp_size, peer_id=reg.peer_id,
                    epoch=reg.epoch, agent_name=reg.agent_name, kv_base=reg.kv_base,
                    layout=layout, dst_pages=list(reg.dst_pages), skip_pages=reg.skip_pages,
                    window_dst_pages=list(reg.window_dst_pages), state_dst_slot=state_slot)

    def _peer_restarted(self, peer_id: str, old_epoch: int) -> None:
        """A decode peer came back with a new epoch: its old memory is gone; fail its rooms."""
        with self._lock:
            for r in list(self._rooms.values()):
                if isinstance(r, KVSender) and any(
                    p.peer_id == peer_id and p.epoch == old_epoch for p in r.peers.values()
                ):
                    r.fail(
                        f"decode peer {peer_id} restarted (epoch {old_epoch:#x} replaced); "
                        "its pages are gone"
                    )
            stale = [a for a, (pid, ep) in self._agent_epoch.items()
                     if pid == peer_id and ep == old_epoch]
            for agent in stale:
                del self._agent_epoch[agent]
        for agent in stale:
            self._writer.forget(agent)
            self.backend.forget(agent)

    # ---- decode -------------------------------------------------------------------------

    def create_receiver(self, room: int, bootstrap_addr: str, dst_pages: list[int], num_tokens: int,
                        skip_pages: int = 0, window_pages: list[int] | None = None,
                        state_slot: int = -1) -> KVReceiver:
        """Register `dst_pages` (decode's page for each request page position) for `room`.

        `window_pages`: the room's window ring (hybrid models, in ring order); prefill lands the
        retained tail of its own ring there, so decode never re-feeds the prompt.
        `state_slot`: the room's recurrent-state slot (models with a recurrent group); prefill
        writes the state after the prompt into it.

        `bootstrap_addr`: the prefill worker's gRPC address(es) (protocol/bootstrap_addr.py);
        with prefill TP > 1 one address will do (the ranks' arrive in ACCEPTED).
        """
        addrs = room_ranks(bootstrap_addr, room)
        if not addrs:
            raise NoBootstrapAddrError(
                f"room {room:#x}: bootstrap_addr is empty; pass the prefill worker's host:port"
            )
        bad = [p for p in dst_pages if not 0 <= p < self.layout.num_pages]
        if bad:
            raise ValueError(
                f"room {room:#x}: dst_pages {bad[:4]} "
                f"outside this pool of {self.layout.num_pages} pages"
            )
        ring = list(window_pages or [])
        group = self.layout.window_group
        if group is not None and len(ring) != group.ring_pages(self.layout.page_size):
            raise ValueError(
                f"room {room:#x}: window_pages has {len(ring)} pages; this layout's window ring "
                f"needs {group.ring_pages(self.layout.page_size)} (window {group.window}, "
                f"page_size {self.layout.page_size})"
            )
        if group is None and ring:
            raise ValueError(
                f"room {room:#x}: window_pages given but this layout has no window region"
            )
        if (state_slot >= 0) != (self.layout.state_group is not None):
            raise ValueError(f"room {room:#x}: a layout with a recurrent group needs the room's "
                             f"state_slot, and only such a layout takes one (got {state_slot})")
        state = {"state_dst_slot": state_slot} if state_slot >= 0 else {}
        if state_slot >= 0:
            self.layout.state_offset(state_slot)  # raises ContractError when out of range
        reg = pb.RoomRegistration(
            room=room, peer_id=self.peer_id, epoch=self.epoch, agent_name=self.backend.agent_name,
            agent_metadata=self.backend.agent_metadata, kv_base=self.kv_ptr,
            kv_nbytes=self.kv_nbytes, dst_pages=dst_pages, skip_pages=skip_pages,
            num_tokens=num_tokens, contract=contract_to_pb(self.contract),
            num_window_pages=self.layout.num_window_pages, window_dst_pages=ring,
            num_state_slots=self.layout.num_state_slots, state_base=self.layout.state_base, **state,
        )
        with self._lock:
            self._check_new(room, "decode")
            receiver = KVReceiver(room, self.config, self._lock, self._room_finished,
                                  contract=self.contract, layout=self.layout, kv_base=self.kv_ptr,
                                  addrs=addrs, registration=reg, channel_of=self._channel,
                                  release=self._release_pool.submit)
            self._rooms[room] = receiver
            return receiver

    def hold_rooms(self, rooms: list[tuple[int, str]]) -> None:
        """(room, bootstrap_addr) of requests waiting for memory: prefill keeps their rooms
        (transfer/holds.py); returns at once."""
        self._holds.hold(rooms)

    def _channel(self, addr: str) -> grpc.Channel:
        with self._lock:
            if addr not in self._channels:
                self._channels[addr] = tls_channel(addr, self.tls)
            return self._channels[addr]

    # ---- both ---------------------------------------------------------------------------

    def _check_new(self, room: int, role: str) -> None:
        if self._closed:
            raise RuntimeError("KVTransferManager is closed")
        if self.role != role:
            raise TransferConfigError(
                f"this manager's role is {self.role}; rooms of role {role} need a {role} manager"
            )
        if room in self._rooms:
            raise RoomExistsError(
                f"room {room:#x} already exists on this rank (room ids must be unique per request)"
            )

    def get(self, room: int) -> Room | None:
        with self._lock:
            return self._rooms.get(room)

    def abort(self, room: int, reason: str) -> None:
        """Abort a room by id; unknown or finished rooms are fine (idempotent)."""
        r = self.get(room)
        if r is not None:
            r.abort(reason)

    def poll_all(self) -> None:
        """Advance every live room's deadline; fence a lane stuck in a backend call."""
        with self._lock:
            rooms = list(self._rooms.values())
        for r in rooms:
            r.poll()
        self._writer.check()

    def take_finished(self) -> list[Room]:
        """Rooms that ended since the last call, each returned exactly once (then forgotten)."""
        self.poll_all()
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
            for r in out:
                self._rooms.pop(r.room, None)
            return out

    def room_counts(self) -> dict[str, int]:
        """Rooms not yet taken, by state name."""
        with self._lock:
            counts = {s.name: 0 for s in RoomState}
            for r in self._rooms.values():
                counts[r.state.name] += 1
            return counts

    def totals(self) -> TransferTotals:
        with self._lock:
            return self._totals

    def _room_finished(self, room: Room) -> None:
        """Called once per room, under the lock, when it enters a terminal state."""
        self._finished.append(room)
        t = self._totals
        self._totals = replace(
            t, rooms_succeeded=t.rooms_succeeded + (room.state is RoomState.SUCCESS),
            rooms_failed=t.rooms_failed + (room.state is RoomState.FAILED),
            rooms_aborted=t.rooms_aborted + (room.state is RoomState.ABORTED),
            pages=t.pages + room.stats.pages, bytes=t.bytes + room.stats.bytes,
            writes=t.writes + room.stats.writes,
        )

    def close(self) -> None:
        """Abort live rooms, stop the transfer thread, close channels, free the backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room_added.notify_all()
            for r in list(self._rooms.values()):
                r.abort("transfer manager closing")
        self._writer.close()
        self._release_pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()
        self.backend.close()
