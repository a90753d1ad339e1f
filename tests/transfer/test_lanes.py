"""Per-peer write lanes (transfer/lanes.py): a decode peer that stops answering blocks no
other peer, its rooms fail on time blaming it, it is fenced until it answers again.

The lane state machine runs against GatedBackend (writes to a chosen peer hang) with real
managers and real gRPC; `test_sigstop_mooncake_peer` does the same with Mooncake and a decode
rank in another process that is really stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from tests.transfer.fake_backend import FakeBackend
from tests.transfer.gated_backend import GatedBackend
from tests.transfer.helpers import Rank, layout, page_bytes_of, wait_finished
from transfer.backend import TransferBackend, TransferFaults
from transfer.config import TransferConfig
from transfer.lanes import PeerState
from transfer.manager import KVTransferManager
from transfer.room import Room, RoomState, Side

TIMEOUT_S = 0.6  # transfer_timeout_s of these managers


def _rank(role: str, backend: TransferBackend, config: TransferConfig) -> Rank:
    lay = layout()
    pool = (torch.randint(0, 256, (lay.pool_bytes,), dtype=torch.uint8) if role == "prefill"
            else torch.zeros(lay.pool_bytes, dtype=torch.uint8))
    mgr = KVTransferManager(config, lay, role=role, kv_ptr=pool.data_ptr(), kv_nbytes=pool.numel(),
                            host="127.0.0.1", model_fingerprint="fp", faults=TransferFaults(),
                            backend=backend)
    rank = Rank(mgr, pool)
    if role == "prefill":
        rank.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        mgr.add_to_server(rank.server)
        rank.addr = f"127.0.0.1:{rank.server.add_insecure_port('127.0.0.1:0')}"
        rank.server.start()
    return rank


class Trio:
    """One prefill rank writing to two decode ranks, A and B."""

    def __init__(self, cancellable: bool) -> None:
        config = TransferConfig(transfer_timeout_s=TIMEOUT_S, bootstrap_timeout_s=5.0,
                                waiting_timeout_s=5.0)
        self.gate = GatedBackend(cancellable=cancellable)
        self.p = _rank("prefill", self.gate, config)
        self.a = _rank("decode", FakeBackend(), config)
        self.b = _rank("decode", FakeBackend(), config)
        self._room = 0

    def agent(self, d: Rank) -> str:
        return d.manager.backend.agent_name

    def room(self, d: Rank, pages: list[int], src: list[int]) -> tuple[Room, Room]:
        """A room from prefill to `d`, registered and sent (last=True)."""
        self._room += 1
        recv = d.manager.create_receiver(self._room, self.p.addr, pages, num_tokens=len(pages) * 4)
        send = self.p.manager.create_sender(self._room)
        send.send(src, start_page=0, last=True, first_token=7)
        return send, recv

    def drain(self) -> None:
        for r in (self.p, self.a, self.b):
            r.manager.take_finished()

    def close(self) -> None:
        for r in (self.a, self.b, self.p):
            r.close()


@pytest.fixture
def trio() -> Iterator[Trio]:
    t = Trio(cancellable=False)
    yield t
    t.close()


def _wait(pred: object, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s}s"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_frozen_peer_blocks_no_other_peer_and_is_blamed(trio: Trio) -> None:
    trio.gate.frozen.add(trio.agent(trio.a))
    t0 = time.monotonic()
    send_a, recv_a = trio.room(trio.a, [0, 1], [2, 3])
    _wait(lambda: trio.gate.in_flight(trio.agent(trio.a)) == 1, 3, "the write to A in flight")
    send_b, recv_b = trio.room(trio.b, [4, 5], [6, 7])
    wait_finished([send_b, recv_b], timeout_s=3)
    assert recv_b.state is RoomState.SUCCESS, recv_b.error  # B's write did not wait for A's
    assert time.monotonic() - t0 < TIMEOUT_S, "B's room waited behind A's write"
    assert page_bytes_of(trio.b, 4) == page_bytes_of(trio.p, 6)
    wait_finished([send_a, recv_a], timeout_s=TIMEOUT_S + 1.0)
    took = time.monotonic() - t0
    assert send_a.state is RoomState.FAILED and recv_a.state is RoomState.FAILED
    assert took < TIMEOUT_S + 1.0, f"A's room failed after {took:.2f}s"
    for room in (send_a, recv_a):  # both sides blame decode A, the one that stopped answering
        assert room.fault is Side.DECODE and room.timed_out, (room.fault, room.error)
    # The lane's write deadline or the room's own TRANSFERRING deadline: whichever came first.
    assert any(w in (send_a.error or "") for w in ("not confirmed", "fenced", "transfer_timeout_s"))
    assert recv_b.fault is None and send_b.fault is None
    states = trio.p.manager.peer_states()
    assert states[trio.agent(trio.a)] is PeerState.FENCED
    assert states[trio.agent(trio.b)] is PeerState.ACTIVE
    trio.drain()


def test_fenced_peer_refused_until_its_late_write_lands(trio: Trio) -> None:
    a = trio.agent(trio.a)
    trio.gate.frozen.add(a)
    send, recv = trio.room(trio.a, [0, 1], [2, 3])
    wait_finished([send, recv], timeout_s=TIMEOUT_S + 1.0)
    # The write cannot be stopped (like Mooncake's): ReleaseRoom must not say "drained" yet.
    drained, _ = trio.p.manager.release_room(send.room, "test", 0.1)
    assert not drained, "ReleaseRoom answered drained with a write still in flight"
    # A new room to the fenced peer is refused at registration, blaming decode.
    send2, recv2 = trio.room(trio.a, [4], [5])
    wait_finished([send2, recv2], timeout_s=1.0)
    assert recv2.state is RoomState.FAILED and recv2.fault is Side.DECODE
    assert "fenced" in (recv2.error or ""), recv2.error
    trio.gate.thaw(a)  # A answers again: its late write lands, the fence lifts
    _wait(lambda: trio.p.manager.peer_states()[a] is PeerState.ACTIVE, 2, "the fence lifted")
    drained, _ = trio.p.manager.release_room(send.room, "test", 1.0)
    assert drained
    send3, recv3 = trio.room(trio.a, [6], [7])
    wait_finished([send3, recv3], timeout_s=2)
    assert recv3.state is RoomState.SUCCESS, recv3.error
    trio.drain()


def test_cancellable_write_is_stopped_at_the_deadline_and_probed_later() -> None:
    t = Trio(cancellable=True)
    try:
        a = t.agent(t.a)
        t.gate.frozen.add(a)
        send, recv = t.room(t.a, [0], [1])
        wait_finished([send, recv], timeout_s=TIMEOUT_S + 1.0)
        assert t.gate.in_flight(a) == 0, "the stuck write was not cancelled"
        drained, _ = t.p.manager.release_room(send.room, "test", 0.5)
        assert drained  # cancelled: nothing of it can land
        assert t.p.manager.peer_states()[a] is PeerState.FENCED
        t.gate.thaw(a)
        time.sleep(TIMEOUT_S)  # then one write goes through as a probe
        send2, recv2 = t.room(t.a, [2], [3])
        wait_finished([send2, recv2], timeout_s=2)
        assert recv2.state is RoomState.SUCCESS, recv2.error
        assert t.p.manager.peer_states()[a] is PeerState.ACTIVE
        t.drain()
    finally:
        t.close()


def test_lane_stuck_in_submit_fails_its_queue_on_time(trio: Trio) -> None:
    a = trio.agent(trio.a)
    trio.gate.stuck_submit.add(a)  # a handshake to a frozen peer: submit itself blocks
    send1, recv1 = trio.room(trio.a, [0], [1])
    send2, recv2 = trio.room(trio.a, [2], [3])
    t0 = time.monotonic()
    while not (send1.state.finished and send2.state.finished):
        trio.p.manager.poll_all()  # the engine's poll: deadlines and the lane supervisor
        assert time.monotonic() - t0 < TIMEOUT_S + 1.5, "rooms behind a stuck submit hung"
        time.sleep(0.02)
    assert send1.state is RoomState.FAILED and send2.state is RoomState.FAILED
    assert send2.fault is Side.DECODE
    trio.gate.thaw(a)
    trio.drain()


# ---- the real thing: Mooncake, and a decode rank in another process, SIGSTOPped ----------------

DECODE_PROC = """
import sys, time, torch
from tests.transfer.helpers import layout
from transfer.config import TransferConfig
from transfer.manager import KVTransferManager
lay = layout()
pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8)
cfg = TransferConfig(transfer_timeout_s=float(sys.argv[2]), bootstrap_timeout_s=10,
                     waiting_timeout_s=10)
m = KVTransferManager(cfg, lay, role="decode", kv_ptr=pool.data_ptr(), kv_nbytes=pool.numel(),
                      host="127.0.0.1", model_fingerprint="fp")
r = m.create_receiver(1, sys.argv[1], [0, 1, 2, 3], num_tokens=16)
print("registered", flush=True)
while not r.state.finished:
    time.sleep(0.01)
print("ended", r.state.name, flush=True)
time.sleep(30)
"""


def _stopped(pid: int) -> bool:
    """The process is in state T (stopped): SIGSTOP reached all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_sigstop_mooncake_peer() -> None:
    """Prefill writes to two Mooncake decode ranks; one (another process) is SIGSTOPped with a
    write to it in flight: the other's rooms keep succeeding, the stopped one's room fails
    within transfer_timeout_s + 1 s blaming it, and the lane is fenced until SIGCONT."""
    timeout = 1.5
    config = TransferConfig(transfer_timeout_s=timeout, bootstrap_timeout_s=10,
                            waiting_timeout_s=10)
    from transfer.factory import make_backend

    p = _rank("prefill", make_backend(config, "127.0.0.1", "p"), config)
    b = _rank("decode", make_backend(config, "127.0.0.1", "b"), config)
    proc = subprocess.Popen([sys.executable, "-c", DECODE_PROC, p.addr, str(timeout)],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        send = p.manager.create_sender(1)
        _wait(lambda: send.state is RoomState.WAITING_FOR_INPUT, 10, "the remote decode registered")
        os.kill(proc.pid, signal.SIGSTOP)
        _wait(lambda: _stopped(proc.pid), 5, "the decode process stopped")
        t0 = time.monotonic()
        send.send([4, 5, 6, 7], start_page=0, last=True, first_token=3)
        for room in range(2, 6):  # the other peer keeps being served meanwhile
            recv = b.manager.create_receiver(room, p.addr, [room], num_tokens=4)
            other = p.manager.create_sender(room)
            other.send([room + 4], start_page=0, last=True, first_token=1)
            wait_finished([other, recv], timeout_s=timeout)
            assert recv.state is RoomState.SUCCESS, recv.error
        while not send.state.finished:
            p.manager.poll_all()
            assert time.monotonic() - t0 < timeout + 1.0, "the stopped peer's room was late"
            time.sleep(0.01)
        assert send.state is RoomState.FAILED and send.fault is Side.DECODE
        agents = [a for a, s in p.manager.peer_states().items() if s is PeerState.FENCED]
        assert len(agents) == 1 and agents[0] != b.manager.backend.agent_name
        os.kill(proc.pid, signal.SIGCONT)  # it answers: the orphaned write lands, the fence lifts
        _wait(lambda: p.manager.peer_states()[agents[0]] is PeerState.ACTIVE, 10, "fence lifted")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        b.close()
        p.close()
