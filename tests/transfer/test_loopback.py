"""Both real backends over loopback: bit-exact pages (incl. heterogeneous TP), deadlines in every
state, aborts from either side, decode restarts (epochs), contract mismatch, corruption caught."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import grpc
import pytest

from protocol import bootstrap_pb2 as pb
from protocol import bootstrap_pb2_grpc as pb_grpc
from tests.transfer.helpers import (
    Cluster,
    head_slice,
    layout,
    make_cluster,
    make_rank,
    page_bytes_of,
    wait_finished,
    wait_state,
)
from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from transfer.room import RoomState
from transfer.wire import contract_to_pb

BACKENDS = ["mooncake", "nixl"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# Clusters shared by a module's tests (a mooncake engine takes ~1 s to destroy, GIL held):
# every test uses its own room ids and leaves no room behind; fault drills are set per test.
@pytest.fixture(scope="module", params=BACKENDS)
def _shared(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = make_cluster(str(request.param), layout(), layout(), checksum=True)
    yield c
    c.close()


@pytest.fixture(scope="module", params=BACKENDS)
def _short(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = make_cluster(
        str(request.param),
        layout(),
        layout(),
        bootstrap_timeout_s=0.5,
        waiting_timeout_s=0.5,
        transfer_timeout_s=0.5,
    )
    yield c
    c.close()


def _clean(c: Cluster) -> Iterator[Cluster]:
    yield c
    for r in c.prefill + c.decode:
        r.manager.faults = TransferFaults()
        r.manager.take_finished()
        live = {k: v for k, v in r.manager.room_counts().items() if v}
        assert not live, f"rooms left behind: {live}"


@pytest.fixture
def pair(_shared: Cluster) -> Iterator[Cluster]:
    """One prefill and one decode rank (checksum on), shared within the module."""
    yield from _clean(_shared)


@pytest.fixture
def short(_short: Cluster) -> Iterator[Cluster]:
    """Like `pair`, with 0.5 s deadlines in every state."""
    yield from _clean(_short)


def _run_room(
    c: Cluster, room: int, n: int, *, skip: int = 0, chunks: int = 2, seed: int = 0, addr: str = ""
) -> tuple[list[int], list[int]]:
    """One room: every decode rank registers; every prefill rank sends n pages in `chunks` pieces.
    """
    rng = random.Random(seed)
    src = rng.sample(range(c.prefill[0].manager.layout.num_pages), n)
    dst = rng.sample(
        range(c.decode[0].manager.layout.num_pages), n + 1
    )  # +1: the first token's page
    receivers = [
        d.manager.create_receiver(
            room, addr or c.bootstrap_addr, dst, num_tokens=n * 4, skip_pages=skip
        )
        for d in c.decode
    ]
    senders = [p.manager.create_sender(room) for p in c.prefill]
    bounds = [n * i // chunks for i in range(chunks + 1)]
    for s in senders:
        for i in range(chunks):
            lo, hi = bounds[i], bounds[i + 1]
            s.send(
                src[lo:hi], start_page=lo, last=i == chunks - 1, first_token=7, first_logprob=-0.25
            )
    wait_finished(receivers + senders)
    for r in receivers + senders:
        assert r.state is RoomState.SUCCESS, r.error
    for d in c.decode:
        taken = d.manager.take_finished()
        assert [t.room for t in taken] == [room] and d.manager.take_finished() == []
    return src, dst


def _check_landed(c: Cluster, src: list[int], dst: list[int], skip: int) -> None:
    lay0 = c.decode[0].manager.layout
    for d in c.decode:
        for pos, (sp, dp) in enumerate(zip(src, dst, strict=False)):
            for layer in range(lay0.num_layers):
                for kv in (0, 1):
                    for h in d.manager.layout.heads:
                        owner = next(p for p in c.prefill if h in p.manager.layout.heads)
                        got = head_slice(d, dp, layer, kv, h)
                        if pos < skip:
                            assert got == bytes(len(got)), "skipped pages stay untouched"
                        else:
                            assert got == head_slice(owner, sp, layer, kv, h), (pos, layer, kv, h)
        assert page_bytes_of(d, dst[-1]) == bytes(lay0.page_bytes), (
            "the first token's page is not written"
        )


LAYOUTS = {
    # name: (heads, prefill tp, decode tp, page_size, dtype, layers, head_dim)
    "same-tp-p4-fp32": (2, 1, 1, 4, "float32", 2, 8),
    "same-tp-p16-bf16": (4, 1, 1, 16, "bfloat16", 3, 16),
    "p2-to-d1": (4, 2, 1, 8, "bfloat16", 2, 8),
    "p1-to-d2": (4, 1, 2, 8, "float32", 2, 8),
    "gqa-p4-to-d1": (2, 4, 1, 4, "float32", 2, 8),
    "gqa-p1-to-d4": (2, 1, 4, 4, "float32", 2, 8),
}
# Planning is backend-independent (test_plan.py covers it exhaustively); each backend moves a
# same-TP layout, a merge, and a split/replica case, so that both carry every kind for real.
CASES = [
    ("mooncake", "same-tp-p4-fp32"),
    ("mooncake", "same-tp-p16-bf16"),
    ("mooncake", "p2-to-d1"),
    ("mooncake", "gqa-p1-to-d4"),
    ("nixl", "same-tp-p16-bf16"),
    ("nixl", "p1-to-d2"),
    ("nixl", "gqa-p4-to-d1"),
    ("mooncake", "gqa-p4-to-d1"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("backend_name", "name"), CASES)
def test_pages_land_bit_exact(backend_name: str, name: str) -> None:
    heads, p_tp, d_tp, ps, dtype, layers, hd = LAYOUTS[name]
    pl = [
        layout(
            num_pages=24,
            page_size=ps,
            dtype=dtype,
            num_layers=layers,
            head_dim=hd,
            heads=heads,
            tp_rank=r,
            tp_size=p_tp,
        )
        for r in range(p_tp)
    ]
    dl = [
        layout(
            num_pages=32,
            page_size=ps,
            dtype=dtype,
            num_layers=layers,
            head_dim=hd,
            heads=heads,
            tp_rank=r,
            tp_size=d_tp,
        )
        for r in range(d_tp)
    ]
    c = make_cluster(backend_name, pl, dl, checksum=True)
    try:
        skip = 2 if name.startswith("same") else 0
        # with prefill TP > 1, decode gets only rank 0's address (as from the gateway) on mooncake,
        # every rank's address on nixl: both ways of finding the prefill ranks are exercised
        addr = c.prefill[0].addr if backend_name == "mooncake" else c.bootstrap_addr
        src, dst = _run_room(c, 0xABC, 9, skip=skip, seed=len(name), addr=addr)
        _check_landed(c, src, dst, skip)
        assert c.decode[0].manager.totals().rooms_succeeded == 1
        sent = sum(p.manager.totals().bytes for p in c.prefill)
        assert sent == sum(d.manager.totals().bytes for d in c.decode)
        expected = sum(d.manager.layout.page_bytes for d in c.decode) * (9 - skip)
        assert sent == expected, "each destination byte is written once"
    finally:
        c.close()


def test_first_token_and_counters(pair: Cluster) -> None:
    recv = pair.decode[0].manager.create_receiver(5, pair.bootstrap_addr, [3, 4, 5], num_tokens=9)
    send = pair.prefill[0].manager.create_sender(5)
    send.send(
        [0, 1],
        start_page=0,
        last=True,
        first_token=11,
        first_logprob=-1.5,
        top_logprobs=[(11, -1.5), (2, -2.0)],
    )
    wait_finished([recv, send])
    assert recv.state is RoomState.SUCCESS, recv.error
    assert (recv.first_token, recv.first_logprob, recv.top_logprobs) == (
        11,
        -1.5,
        [(11, -1.5), (2, -2.0)],
    )
    pb_ = pair.decode[0].manager.layout.page_bytes
    assert (
        (recv.stats.pages, recv.stats.bytes) == (2, 2 * pb_) == (send.stats.pages, send.stats.bytes)
    )
    assert page_bytes_of(pair.decode[0], 4) == page_bytes_of(pair.prefill[0], 1)
    assert pair.prefill[0].manager.room_counts()["SUCCESS"] == 1
    assert [r.room for r in pair.prefill[0].manager.take_finished()] == [5]
    assert pair.prefill[0].manager.take_finished() == []


def test_send_before_decode_registers_is_queued(pair: Cluster) -> None:
    send = pair.prefill[0].manager.create_sender(7)
    send.send([2], start_page=0, last=False)
    send.send([3], start_page=1, last=True, first_token=4)
    assert send.poll() is RoomState.BOOTSTRAPPING
    recv = pair.decode[0].manager.create_receiver(7, pair.bootstrap_addr, [8, 9, 10], num_tokens=6)
    wait_finished([recv, send])
    assert recv.state is RoomState.SUCCESS and recv.first_token == 4, recv.error
    assert page_bytes_of(pair.decode[0], 9) == page_bytes_of(pair.prefill[0], 3)


# ---- deadlines in every state ---------------------------------------------------------------


def test_deadline_bootstrapping(short: Cluster) -> None:
    """Prefill never creates the room / decode never registers: both sides end and can free."""
    orphan_sender = short.prefill[0].manager.create_sender(1)  # decode never registers
    orphan_recv = short.decode[0].manager.create_receiver(
        2, short.bootstrap_addr, [0], num_tokens=4
    )  # no prefill room
    wait_finished([orphan_sender, orphan_recv])
    assert orphan_sender.state is RoomState.FAILED and "bootstrap_timeout_s" in (
        orphan_sender.error or ""
    )
    assert orphan_recv.state is RoomState.FAILED and "bootstrap_timeout_s" in (
        orphan_recv.error or ""
    )
    assert [r.room for r in short.prefill[0].manager.take_finished()] == [1]
    assert [r.room for r in short.decode[0].manager.take_finished()] == [2]


def test_hold_keeps_a_bootstrapping_room(short: Cluster) -> None:
    """A decode worker with the room's request but no memory for it yet holds the room
    (HoldRoom) past bootstrap_timeout_s (0.5 s here); once it registers the room succeeds.
    A room nobody holds still fails its deadline."""
    held = short.prefill[0].manager.create_sender(40)
    unheld = short.prefill[0].manager.create_sender(41)
    held.send([2], start_page=0, last=True, first_token=5)
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        short.decode[0].manager.hold_rooms([(40, short.bootstrap_addr)])  # returns at once
        time.sleep(0.15)
        assert held.poll() is RoomState.BOOTSTRAPPING, held.error
    assert unheld.poll() is RoomState.FAILED and "bootstrap_timeout_s" in (unheld.error or "")
    recv = short.decode[0].manager.create_receiver(40, short.bootstrap_addr, [3], num_tokens=4)
    wait_finished([recv, held])
    assert recv.state is RoomState.SUCCESS and recv.first_token == 5, recv.error
    assert page_bytes_of(short.decode[0], 3) == page_bytes_of(short.prefill[0], 2)


def test_hold_room_answers(short: Cluster) -> None:
    """HoldRoom says whether it held a room, and refuses a decode incarnation since replaced."""
    sender = short.prefill[0].manager.create_sender(42)
    with grpc.insecure_channel(short.bootstrap_addr) as ch:
        stub = pb_grpc.BootstrapStub(ch)
        assert stub.HoldRoom(pb.RoomHold(room=42, peer_id="p", epoch=1), timeout=5).held
        assert not stub.HoldRoom(pb.RoomHold(room=43, peer_id="p", epoch=1), timeout=5).held
        stub.HoldRoom(pb.RoomHold(room=43, peer_id="p", epoch=2), timeout=5)  # "p" restarted
        with pytest.raises(grpc.RpcError) as e:
            stub.HoldRoom(pb.RoomHold(room=42, peer_id="p", epoch=1), timeout=5)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION, e.value
    sender.abort("test over")


def test_deadline_waiting_for_input(short: Cluster) -> None:
    recv = short.decode[0].manager.create_receiver(3, short.bootstrap_addr, [0, 1], num_tokens=5)
    send = short.prefill[0].manager.create_sender(3)
    wait_state(send, RoomState.WAITING_FOR_INPUT)
    wait_finished([send, recv])  # prefill never sends
    assert send.state is RoomState.FAILED and "waiting_timeout_s" in (send.error or "")
    assert recv.state is RoomState.FAILED and "waiting_timeout_s" in (recv.error or "")


def test_deadline_transferring(short: Cluster) -> None:
    short.prefill[0].manager.faults = TransferFaults(delay_ms=1500)
    recv = short.decode[0].manager.create_receiver(4, short.bootstrap_addr, [0, 1], num_tokens=5)
    send = short.prefill[0].manager.create_sender(4)
    send.send([2, 3], start_page=0, last=True, first_token=1)
    wait_state(recv, RoomState.TRANSFERRING)
    wait_finished([send, recv])
    assert send.state is RoomState.FAILED and "transfer_timeout_s" in (send.error or "")
    assert recv.state is RoomState.FAILED


# ---- aborts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_mid_transfer(pair: Cluster, side: str) -> None:
    pair.prefill[0].manager.faults = TransferFaults(delay_ms=300)
    room = 60 + (side == "decode")
    recv = pair.decode[0].manager.create_receiver(
        room, pair.bootstrap_addr, [0, 1, 2], num_tokens=9
    )
    send = pair.prefill[0].manager.create_sender(room)
    send.send([4, 5], start_page=0, last=True, first_token=1)
    wait_state(recv, RoomState.TRANSFERRING)  # the write sleeps in its delay: in flight
    aborter = send if side == "prefill" else recv
    aborter.abort("client went away")
    aborter.abort("again")  # idempotent
    wait_finished([send, recv], timeout_s=5)
    assert send.state is RoomState.ABORTED and recv.state is RoomState.ABORTED
    other = recv if side == "prefill" else send
    assert (
        aborter.error == "client went away"
        and other.error
        and ("aborted" in other.error or "cancelled" in other.error)
    )
    for m in (pair.prefill[0].manager, pair.decode[0].manager):
        assert [r.room for r in m.take_finished()] == [room] and m.take_finished() == []


# ---- decode restarts with a new epoch ---------------------------------------------------------


def test_decode_restart_new_epoch(backend: str) -> None:
    config = TransferConfig(backend=backend, bootstrap_timeout_s=2.0)  # type: ignore[arg-type]
    prefill = make_rank("prefill", layout(), config, seed=3)
    old = make_rank("decode", layout(), config, peer_id="decode-A")
    new = None
    try:
        stale_room = old.manager.create_receiver(10, prefill.addr, [0, 1], num_tokens=5)
        s10 = prefill.manager.create_sender(10)
        wait_state(s10, RoomState.WAITING_FOR_INPUT)
        # decode-A restarts: a new manager, same identity, new epoch; the old one lingers (no crash)
        new = make_rank("decode", layout(), config, peer_id="decode-A")
        assert new.manager.epoch != old.manager.epoch
        fresh = new.manager.create_receiver(11, prefill.addr, [2, 3], num_tokens=5)
        s11 = prefill.manager.create_sender(11)
        s11.send([5, 6], start_page=0, last=True, first_token=3)
        wait_finished([fresh, s11])
        assert fresh.state is RoomState.SUCCESS, fresh.error
        assert page_bytes_of(new, 2) == page_bytes_of(prefill, 5)
        wait_finished([s10, stale_room])
        assert s10.state is RoomState.FAILED and "restarted" in (s10.error or "")
        assert stale_room.state is RoomState.FAILED and "restarted" in (stale_room.error or "")
        # a late registration from the old incarnation is refused as stale
        late = old.manager.create_receiver(12, prefill.addr, [0], num_tokens=2)
        wait_finished([late])
        assert (
            late.state is RoomState.FAILED
            and "FAILED_PRECONDITION" in (late.error or "")
            and "stale" in (late.error or "")
        )
        s10.send(
            [1], start_page=0, last=True
        )  # the engine finishing a dead room is a harmless no-op
        assert {r.room for r in prefill.manager.take_finished()} == {10, 11}
    finally:
        for r in (old, new, prefill):
            if r is not None:
                r.close()


# ---- contract mismatch and corruption -------------------------------------------------------


def test_contract_mismatch_refused_with_field_names(pair: Cluster) -> None:
    backend_name = pair.prefill[0].manager.config.backend
    decode = make_rank(
        "decode",
        layout(page_size=8),
        TransferConfig(backend=backend_name),
        fingerprint="other-weights",
    )
    try:
        send = pair.prefill[0].manager.create_sender(20)
        recv = decode.manager.create_receiver(20, pair.bootstrap_addr, [0], num_tokens=3)
        wait_finished([recv])
        assert recv.state is RoomState.FAILED
        assert "INVALID_ARGUMENT" in (recv.error or "") and "page_size: 4 != 8" in (
            recv.error or ""
        )
        assert "model_fingerprint" in (recv.error or "")
        # The raw RPC carries the same status for any client.
        reg = pb.RoomRegistration(
            room=21, peer_id="x", epoch=1, contract=contract_to_pb(decode.manager.contract)
        )
        with grpc.insecure_channel(pair.bootstrap_addr) as ch, pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.BootstrapStub(ch).Register(reg, timeout=5))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        send.abort("test over")
    finally:
        decode.close()


def test_corruption_caught_by_checksum(pair: Cluster) -> None:
    pair.prefill[0].manager.faults = TransferFaults(corrupt=1.0)
    recv = pair.decode[0].manager.create_receiver(30, pair.bootstrap_addr, [0, 1, 2], num_tokens=9)
    send = pair.prefill[0].manager.create_sender(30)
    send.send([3, 4, 5], start_page=0, last=True, first_token=1)
    wait_finished([recv, send])
    assert send.state is RoomState.SUCCESS  # prefill believes its writes landed
    assert recv.state is RoomState.FAILED and "checksum mismatch" in (recv.error or "")
    # the corruption is real: every landed page is mostly garbage
    for dst, src in zip([0, 1, 2], [3, 4, 5], strict=True):
        got, want = page_bytes_of(pair.decode[0], dst), page_bytes_of(pair.prefill[0], src)
        assert sum(a != b for a, b in zip(got, want, strict=True)) > len(got) // 2


def test_injected_write_failure_fails_both_sides(pair: Cluster) -> None:
    pair.prefill[0].manager.faults = TransferFaults(fail=1.0)
    failed_before = pair.prefill[0].manager.totals().rooms_failed
    recv = pair.decode[0].manager.create_receiver(40, pair.bootstrap_addr, [0], num_tokens=3)
    send = pair.prefill[0].manager.create_sender(40)
    send.send([1], start_page=0, last=True, first_token=1)
    wait_finished([recv, send])
    assert send.state is RoomState.FAILED and "injected fault" in (send.error or "")
    assert recv.state is RoomState.FAILED and "injected fault" in (recv.error or "")
    assert pair.prefill[0].manager.totals().rooms_failed == failed_before + 1
