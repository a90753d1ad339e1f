"""Decode's side of HoldRoom: keep the rooms of requests that wait for memory.

A decode worker reserves a request's pages only once its cache has them. Until then the
request waits in the decode role's queue and nothing is registered with prefill, whose room
would fail when transfer.bootstrap_timeout_s passes ("waiting on decode"), though decode is
alive and the room only queued. `RoomHolds.hold` tells every prefill rank of each waiting room
that it is still wanted (HoldRoom restarts the room's bootstrapping deadline there), on a
thread of the manager's pool, never the engine's. The decode role calls it every third of the
deadline while requests wait, so a full decode worker queues rooms and a dead or frozen one
still lets them fail.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from protocol import bootstrap_pb2 as pb
from protocol import bootstrap_pb2_grpc as pb_grpc
from protocol.bootstrap_addr import room_ranks

log = logging.getLogger(__name__)


class RoomHolds:
    """Sends HoldRoom for decode rooms whose requests wait for memory (see the module doc)."""

    def __init__(self, *, peer_id: str, epoch: int, timeout_s: float,
                 channel_of: Callable[[str], grpc.Channel],
                 submit: Callable[[Callable[[], None]], Future[None]]) -> None:
        self._peer_id = peer_id
        self._epoch = epoch
        self._timeout_s = timeout_s  # per call: a third of bootstrap_timeout_s
        self._channel_of = channel_of
        self._submit = submit
        # a prefill address -> every rank's of that worker (TP > 1), as HoldRoom answered
        self._ranks: dict[str, list[str]] = {}

    def hold(self, rooms: list[tuple[int, str]]) -> Future[None]:
        """Hold each (room, bootstrap_addr) on every prefill rank, off the caller's thread."""
        return self._submit(lambda: self._hold_all(rooms))

    def _hold_all(self, rooms: list[tuple[int, str]]) -> None:
        for room, bootstrap_addr in rooms:
            addrs = room_ranks(bootstrap_addr, room)
            if addrs:
                self._hold_one(room, addrs)

    def _hold_one(self, room: int, addrs: list[str]) -> None:
        todo = list(self._ranks.get(addrs[0], addrs))
        done: set[str] = set()
        while todo:
            addr = todo.pop(0)
            done.add(addr)
            stub = pb_grpc.BootstrapStub(self._channel_of(addr))  # type: ignore[no-untyped-call]
            try:
                held = stub.HoldRoom(pb.RoomHold(room=room, peer_id=self._peer_id,
                                                 epoch=self._epoch), timeout=self._timeout_s)
            except grpc.RpcError as e:  # the room's registration reports what is wrong
                log.debug("room %#x: HoldRoom on %s failed: %s", room, addr, e)
                continue
            if len(held.rank_addrs) > 1:  # TP prefill: its other ranks hold the room too
                self._ranks[addrs[0]] = list(held.rank_addrs)
                todo += [a for a in held.rank_addrs if a not in done and a not in todo]
