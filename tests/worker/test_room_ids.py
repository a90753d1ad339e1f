"""A room id the worker already holds ends only the request that repeats it, with a 400-class
error: the engine loop (and with it every other request on the worker) must not die of it.
Real transfer managers (fake backend, real gRPC bootstrap), real schedulers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import layout
from tests.worker.factories import make_request, make_scheduler
from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from transfer.manager import KVTransferManager
from worker.decode import DecodeRole
from worker.prefill import PrefillRole
from worker.request import Request, RequestStatus


def _manager(role: str) -> tuple[KVTransferManager, torch.Tensor]:
    lay = layout(num_pages=64)
    pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8)
    mgr = KVTransferManager(TransferConfig(), lay, role=role, kv_ptr=pool.data_ptr(),
                            kv_nbytes=pool.numel(), host="127.0.0.1", model_fingerprint="fp",
                            model_name="tiny", faults=TransferFaults(), backend=FakeBackend())
    return mgr, pool


@pytest.fixture
def prefill() -> Iterator[tuple[PrefillRole, str]]:
    mgr, pool = _manager("prefill")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    mgr.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    role = PrefillRole(mgr, server, page_size=4, layerwise_interval=0)
    yield role, f"127.0.0.1:{port}"
    role.close()
    del pool


@pytest.fixture
def decode() -> Iterator[DecodeRole]:
    mgr, pool = _manager("decode")
    role = DecodeRole(mgr, page_size=4)
    yield role
    role.close()
    del pool


def _with_room(room: int, bootstrap_addr: str) -> Request:
    req = make_request(10, max_tokens=3)
    req.room, req.bootstrap_addr = room, bootstrap_addr
    return req


def test_prefill_refuses_a_room_it_holds_without_dying(
        prefill: tuple[PrefillRole, str]) -> None:
    role, addr = prefill
    sched, finished = make_scheduler()
    first, second = _with_room(7, addr), _with_room(7, addr)
    role.add_request(first, sched)
    role.add_request(second, sched)  # raised ValueError into the engine loop before
    assert second.status is RequestStatus.FINISHED_ERROR and second.error_code == "invalid"
    assert "room" in second.error and finished == [second]
    assert first.status is RequestStatus.WAITING  # the first owner of the room is untouched
    role.abort(first.request_id, "done")
    sched.end(first.request_id, RequestStatus.FINISHED_ABORTED, "done", "unavailable")
    sched.assert_drained()


def test_decode_refuses_a_room_it_holds_without_dying(
        decode: DecodeRole, prefill: tuple[PrefillRole, str]) -> None:
    sched, finished = make_scheduler()
    # A live bootstrap service confirms the abort's ReleaseRoom, so the quarantine ends at once.
    first, second = _with_room(9, prefill[1]), _with_room(9, prefill[1])
    decode.add_request(first, sched)
    decode.add_request(second, sched)  # raised ValueError into the engine loop before
    assert second.status is RequestStatus.FINISHED_ERROR and second.error_code == "invalid"
    assert "room" in second.error and finished == [second]
    assert first.status is RequestStatus.WAITING_FOR_REMOTE_KV and first.page_table
    decode.abort(first.request_id, "done")
    deadline = time.monotonic() + 10
    while decode.has_work():  # its quarantine ends when prefill confirms the release
        assert time.monotonic() < deadline, "the aborted room's quarantine never ended"
        decode.poll()
        time.sleep(0.005)
    sched.assert_drained()


def test_decode_refuses_a_room_without_a_bootstrap_address(decode: DecodeRole) -> None:
    sched, finished = make_scheduler()
    req = _with_room(11, "")
    decode.add_request(req, sched)  # raised TransferConfigError into the engine loop before
    assert req.status is RequestStatus.FINISHED_ERROR and req.error_code == "invalid"
    assert "bootstrap_addr" in req.error and finished == [req]
    assert not decode.has_work()
    sched.assert_drained()
