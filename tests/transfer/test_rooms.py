"""Room state machines, manager bookkeeping and fault parsing (fake backend; real gRPC)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import Cluster, Rank, layout, page_bytes_of, wait_finished
from transfer.backend import TransferFaults
from transfer.bootstrap import EpochRegistry, StaleEpochError
from transfer.config import TransferConfig, TransferConfigError
from transfer.contract import ContractError
from transfer.factory import make_backend
from transfer.manager import KVTransferManager
from transfer.room import RoomState


def _rank(role: str, config: TransferConfig, tp_rank: int = 0, tp_size: int = 1) -> Rank:
    from concurrent import futures

    import grpc
    import torch

    lay = layout(tp_rank=tp_rank, tp_size=tp_size)
    pool = (
        torch.randint(0, 256, (lay.pool_bytes,), dtype=torch.uint8)
        if role == "prefill"
        else torch.zeros(lay.pool_bytes, dtype=torch.uint8)
    )
    mgr = KVTransferManager(
        config,
        lay,
        role=role,
        kv_ptr=pool.data_ptr(),
        kv_nbytes=pool.numel(),
        host="127.0.0.1",
        model_fingerprint="fp",
        faults=TransferFaults(),
        backend=FakeBackend(),
    )
    rank = Rank(mgr, pool)
    if role == "prefill":
        rank.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        mgr.add_to_server(rank.server)
        rank.addr = f"127.0.0.1:{rank.server.add_insecure_port('127.0.0.1:0')}"
        rank.server.start()
    return rank


@pytest.fixture(scope="module")
def fake() -> Iterator[Cluster]:
    config = TransferConfig(checksum=True)
    c = Cluster(prefill=[_rank("prefill", config)], decode=[_rank("decode", config)])
    yield c
    c.close()


def test_layerwise_chunks_and_finished_exactly_once(fake: Cluster) -> None:
    p, d = fake.prefill[0].manager, fake.decode[0].manager
    recv = d.create_receiver(1, fake.bootstrap_addr, [4, 5, 6, 7], num_tokens=13)
    send = p.create_sender(1)
    send.send([0], start_page=0, last=False)
    send.send([1, 2], start_page=1, last=False)
    assert send.poll() in (RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT)
    send.send([3], start_page=3, last=True, first_token=5)
    with pytest.raises(RuntimeError, match="after send"):
        send.send([3], start_page=3, last=True)
    wait_finished([recv, send])
    assert recv.state is RoomState.SUCCESS, recv.error
    assert all(
        page_bytes_of(fake.decode[0], 4 + i) == page_bytes_of(fake.prefill[0], i) for i in range(4)
    )
    assert send.stats.writes == 3 and recv.stats.pages == 4
    assert [r.room for r in p.take_finished()] == [1] and p.take_finished() == []
    assert [r.room for r in d.take_finished()] == [1] and d.take_finished() == []
    assert not any(p.room_counts().values())
    send.abort("late")  # aborting a finished room changes nothing
    assert send.state is RoomState.SUCCESS and p.take_finished() == []


def test_abort_is_immediate_idempotent_and_keeps_first_reason(fake: Cluster) -> None:
    p = fake.prefill[0].manager
    send = p.create_sender(2)
    send.abort("first")
    send.abort("second")
    assert send.poll() is RoomState.ABORTED and send.error == "first"
    send.send([0], start_page=0, last=True)  # no-op on a finished room
    assert p.totals().rooms_aborted >= 1 and [r.room for r in p.take_finished()] == [2]


def test_manager_refuses_bad_calls_with_named_fields(fake: Cluster) -> None:
    p, d = fake.prefill[0].manager, fake.decode[0].manager
    p.create_sender(3)
    with pytest.raises(ValueError, match="already exists"):
        p.create_sender(3)
    p.abort(3, "cleanup")
    p.abort(12345, "unknown rooms are fine")
    p.take_finished()
    with pytest.raises(TransferConfigError, match="role is decode"):
        d.create_sender(4)
    with pytest.raises(ValueError, match="dst_pages"):
        d.create_receiver(4, fake.bootstrap_addr, [999], num_tokens=1)
    with pytest.raises(TransferConfigError, match="bootstrap_addr"):
        d.create_receiver(4, " ", [0], num_tokens=1)
    with pytest.raises(TransferConfigError, match="add_to_server"):
        d.add_to_server(None)  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="kv_nbytes"):
        KVTransferManager(
            TransferConfig(),
            layout(),
            role="decode",
            kv_ptr=0,
            kv_nbytes=10,
            host="127.0.0.1",
            model_fingerprint="fp",
            backend=FakeBackend(),
        )


def test_rdma_without_devices_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISAGGREGATION_IB_DEVICE", raising=False)
    with pytest.raises(TransferConfigError, match="DISAGGREGATION_IB_DEVICE"):
        make_backend(TransferConfig(protocol="rdma"), "127.0.0.1", "x")


def test_epoch_registry() -> None:
    reg = EpochRegistry()
    assert reg.admit("d0", 5) is None and reg.admit("d0", 5) is None
    assert reg.admit("d0", 9) == 5  # restarted: epoch 5 retired
    with pytest.raises(StaleEpochError, match="stale"):
        reg.admit("d0", 5)
    assert reg.admit("d1", 5) is None  # epochs are per peer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", TransferFaults()),
        ("fail=0.5", TransferFaults(fail=0.5)),
        ("corrupt=1.0, delay_ms=20", TransferFaults(corrupt=1.0, delay_ms=20)),
    ],
)
def test_faults_parse(text: str, expected: TransferFaults) -> None:
    assert TransferFaults.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("fail", "bad item"),
        ("boom=1", "bad item"),
        ("fail=x", "must be a number"),
        ("corrupt=2", r"probability in \[0, 1\]"),
        ("delay_ms=-1", ">= 0"),
    ],
)
def test_faults_parse_errors(text: str, match: str) -> None:
    with pytest.raises(TransferConfigError, match=match):
        TransferFaults.parse(text)


def test_faults_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TRANSFER_FAULTS", "fail=1,delay_ms=5")
    assert TransferFaults.from_env() == TransferFaults(fail=1.0, delay_ms=5)


def test_registration_for_a_room_prefill_already_ended_is_aborted(fake: Cluster) -> None:
    p, d = fake.prefill[0].manager, fake.decode[0].manager
    send = p.create_sender(50)
    send.abort("client disconnected")
    recv = d.create_receiver(50, fake.bootstrap_addr, [0], num_tokens=2)
    wait_finished([recv])
    assert recv.state is RoomState.ABORTED and "client disconnected" in (recv.error or "")
    assert [r.room for r in p.take_finished()] == [50] and [r.room for r in d.take_finished()] == [
        50
    ]


def test_prefill_tp_without_rank_addresses_is_refused_readably() -> None:
    config = TransferConfig()
    c = Cluster(
        prefill=[_rank("prefill", config, r, 2) for r in range(2)], decode=[_rank("decode", config)]
    )
    try:
        with pytest.raises(TransferConfigError, match="one host:port per prefill rank"):
            c.prefill[0].manager.set_tp_bootstrap_addrs(["a:1"])
        senders = [p.manager.create_sender(60) for p in c.prefill]
        recv = c.decode[0].manager.create_receiver(60, c.prefill[0].addr, [0], num_tokens=2)
        wait_finished([recv])
        assert recv.state is RoomState.FAILED and "set_tp_bootstrap_addrs" in (recv.error or "")
        for s in senders:
            s.abort("test over")
    finally:
        c.close()
