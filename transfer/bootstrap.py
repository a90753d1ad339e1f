"""The bootstrap service: where decode ranks register their pages with a prefill rank.

It runs in the prefill worker's own grpc.Server (`add_to_server`), so the bootstrap address is
the worker's gRPC address. One server-streaming call per (room, decode rank):

1. Check the registration: contract compatible (INVALID_ARGUMENT naming the fields), pages
   inside decode's registered pool (INVALID_ARGUMENT), epoch not stale (FAILED_PRECONDITION).
   A new epoch from a known decode peer means it restarted: its old rooms fail at once.
2. Wait for the prefill room (both legs are dispatched in parallel, so decode may be first);
   NOT_FOUND after bootstrap_timeout_s.
3. Attach the decode rank to the room and stream its events until the room ends; if decode
   cancels the call (aborted or gone), the room is aborted here. A decode agent whose writes
   went unconfirmed is fenced (transfer/lanes.py): its registration gets a FAILED event naming
   decode as the side at fault, and the room fails here too.

`HoldRoom` (unary) is how a decode worker that has a room's request but no memory for it yet
keeps the room: it restarts the room's bootstrapping deadline, and decode repeats it while the
request waits (a full decode worker queues rooms; a dead or frozen one still lets them fail).

`ReleaseRoom` (unary) is how decode takes its pages back from a room that ended before DONE:
prefill aborts the room, refuses any later registration for it, and answers only once no write
of the room is in flight (at most transfer_timeout_s), so decode never reuses a page a late
write could still land in.

Each open call holds one thread of the server's pool: size `max_workers` for the concurrent
rooms a worker admits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from protocol import bootstrap_pb2 as pb
from protocol import bootstrap_pb2_grpc as pb_grpc
from transfer.config import TransferConfig
from transfer.contract import ContractError, LayoutContract
from transfer.room import Side
from transfer.sender import KVSender, Peer, RoomEndedError
from transfer.wire import contract_from_pb, contract_to_pb


class StaleEpochError(Exception):
    """A registration from a decode incarnation that has since been replaced."""


class EpochRegistry:
    """Latest epoch per decode peer; epochs are random, so "older" means "seen, then replaced"."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}
        self._retired: dict[str, set[int]] = {}

    def admit(self, peer_id: str, epoch: int) -> int | None:
        """Accept `epoch` for `peer_id`; returns the epoch it replaces, if any.

        Raises StaleEpochError for an epoch this peer already moved past.
        """
        if epoch in self._retired.get(peer_id, set()):
            raise StaleEpochError(
                f"decode peer {peer_id!r} epoch {epoch:#x} is stale: it re-registered with epoch "
                f"{self._current[peer_id]:#x} since (that process restarted; retry on the new one)"
            )
        old = self._current.get(peer_id)
        self._current[peer_id] = epoch
        if old is None or old == epoch:
            return None
        self._retired.setdefault(peer_id, set()).add(old)
        return old


class BootstrapService(pb_grpc.BootstrapServicer):
    """Servicer for one prefill rank; talks to its manager through the callables it is given."""

    def __init__(
        self, config: TransferConfig, contract: LayoutContract, lock: threading.RLock, *,
        wait_sender: Callable[[int, float], KVSender | None],
        connect_peer: Callable[[pb.RoomRegistration], Peer],
        peer_restarted: Callable[[str, int], None],
        rank_addrs: Callable[[], list[str]],
        release_room: Callable[[int, str, float], tuple[bool, float]],
        hold_room: Callable[[int], bool],
        peer_refusal: Callable[[str], str | None] = lambda agent: None,
    ) -> None:
        self._config = config
        self._contract = contract
        self._lock = lock
        self._wait_sender = wait_sender
        self._connect_peer = connect_peer
        self._peer_restarted = peer_restarted
        self._rank_addrs = rank_addrs
        self._release_room = release_room
        self._hold_room = hold_room  # HoldRoom: restart a bootstrapping room's deadline
        self._peer_refusal = peer_refusal  # a fenced decode agent takes no new rooms
        self._epochs = EpochRegistry()

    def Register(self, request: pb.RoomRegistration,
                 context: grpc.ServicerContext) -> Iterator[pb.RoomEvent]:
        try:
            theirs = contract_from_pb(request.contract)
            self._contract.check_compatible(theirs)
        except ContractError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {request.room:#x}: {e}")
        self._admit(request.peer_id, request.epoch, context)
        sender = self._wait_sender(request.room, self._config.bootstrap_timeout_s)
        if sender is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"room {request.room:#x} unknown on this "
                          "prefill rank after "
                          f"transfer.bootstrap_timeout_s={self._config.bootstrap_timeout_s}s")
            return  # abort() raises; the return is for readers and type checkers
        refused = self._peer_refusal(request.agent_name)
        if refused is not None:  # its agent does not answer our writes: its own fault
            sender.fail(f"room {request.room:#x}: {refused}", fault=Side.DECODE, timed_out=True)
            yield pb.RoomEvent(kind=pb.RoomEvent.FAILED, reason=refused, fault=Side.DECODE.value,
                               timed_out=True)
            return
        try:
            peer = self._connect_peer(request)
            sender.attach(peer)
        except RoomEndedError as e:
            context.abort(grpc.StatusCode.ABORTED, str(e))
            return
        except (ValueError, ContractError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except RuntimeError as e:  # BackendError: could not reach decode's agent
            sender.fail(str(e))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            return
        context.add_callback(lambda: sender.peer_gone(peer, "cancelled its registration"))
        yield pb.RoomEvent(kind=pb.RoomEvent.ACCEPTED, contract=contract_to_pb(self._contract),
                           rank_addrs=self._rank_addrs())
        yield from self._stream(sender, peer, context)

    def HoldRoom(self, request: pb.RoomHold, context: grpc.ServicerContext) -> pb.RoomHeld:
        self._admit(request.peer_id, request.epoch, context)
        return pb.RoomHeld(held=self._hold_room(request.room), rank_addrs=self._rank_addrs())

    def _admit(self, peer_id: str, epoch: int, context: grpc.ServicerContext) -> None:
        """Refuse a stale epoch; a new one from a known peer fails that peer's old rooms."""
        with self._lock:
            try:
                replaced = self._epochs.admit(peer_id, epoch)
            except StaleEpochError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            if replaced is not None:
                self._peer_restarted(peer_id, replaced)

    def ReleaseRoom(self, request: pb.RoomRelease,
                    context: grpc.ServicerContext) -> pb.RoomReleased:
        drained, waited_s = self._release_room(
            request.room, f"{request.peer_id}: {request.reason}", self._config.transfer_timeout_s)
        return pb.RoomReleased(drained=drained, waited_ms=waited_s * 1e3)

    def _stream(self, sender: KVSender, peer: Peer,
                context: grpc.ServicerContext) -> Iterator[pb.RoomEvent]:
        terminal = (pb.RoomEvent.DONE, pb.RoomEvent.FAILED, pb.RoomEvent.ABORTED)
        while context.is_active():
            try:
                ev = peer.events.get(timeout=0.05)
            except queue.Empty:
                sender.poll()  # deadlines advance even while the engine is busy
                continue
            yield ev
            if ev.kind in terminal:
                return
        # Falling out here means decode cancelled the call; add_callback aborts the room.
