"""A room id the worker already holds ends only the request that repeats it, with a 400-class
error: the engine loop (and with it every other request on the worker) must not die of it.
Real transfer managers (fake backend, real gRPC bootstrap), real schedulers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.worker.factories import make_scheduler
from tests.worker.roles import decode_role, prefill_role
from tests.worker.roles import with_room as _with_room
from worker.decode import DecodeRole
from worker.prefill import PrefillRole
from worker.request import RequestStatus


@pytest.fixture
def prefill() -> Iterator[tuple[PrefillRole, str]]:
    with prefill_role() as role:
        yield role


@pytest.fixture
def decode() -> Iterator[DecodeRole]:
    with decode_role() as role:
        yield role


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
