"""A prefill write in flight must never land in pages decode has already reused.

Real managers and a real backend (mooncake over loopback); a `delay_ms` drill holds each write
in flight long enough to abort the room under it. The control test shows the window is real
(the write does land after decode's abort); the others show decode's receiver only reports
`quiesced` (pages reusable) once prefill has confirmed ReleaseRoom, or its quarantine ran out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.transfer.helpers import Cluster, layout, make_cluster, page_bytes_of, wait_state
from transfer.backend import TransferFaults
from transfer.room import RoomState

pytestmark = pytest.mark.chaos

DELAY_MS = 400
MARK = 0xAB


@pytest.fixture(scope="module")
def pair() -> Iterator[Cluster]:
    c = make_cluster(
        "mooncake", layout(), layout(), transfer_timeout_s=3.0, bootstrap_timeout_s=3.0
    )
    yield c
    c.close()


def _start_slow_room(c: Cluster, room: int, pages: list[int]) -> tuple[object, object]:
    c.prefill[0].manager.faults = TransferFaults(delay_ms=DELAY_MS)
    recv = c.decode[0].manager.create_receiver(
        room, c.bootstrap_addr, pages, num_tokens=len(pages) * 4 - 1
    )
    send = c.prefill[0].manager.create_sender(room)
    send.send([4, 5], start_page=0, last=True, first_token=1)
    wait_state(recv, RoomState.TRANSFERRING)  # the write now sleeps in its delay: in flight
    return send, recv


def _mark(c: Cluster, pages: list[int]) -> None:
    """Decode reuses the pages: another request's KV goes in (a recognisable byte here)."""
    pb = c.decode[0].manager.layout.page_bytes
    for p in pages:
        c.decode[0].pool[p * pb : (p + 1) * pb] = MARK


def _marked(c: Cluster, pages: list[int]) -> bool:
    return all(set(page_bytes_of(c.decode[0], p)) == {MARK} for p in pages)


def _drain(c: Cluster) -> None:
    for r in c.prefill + c.decode:
        r.manager.faults = TransferFaults()
        r.manager.take_finished()


def test_control_abort_alone_leaves_a_write_in_flight(pair: Cluster) -> None:
    """Without waiting for quiescence, pages reused at once get overwritten by the late write."""
    pages = [0, 1]
    send, recv = _start_slow_room(pair, 0x51, pages)
    recv.abort("client went away")  # type: ignore[attr-defined]
    _mark(pair, pages)
    time.sleep(DELAY_MS / 1e3 + 0.4)  # the in-flight write finishes meanwhile
    assert not _marked(pair, pages), (
        "the late write did not land: this drill no longer opens the window"
    )
    _drain(pair)


def test_quiesced_only_after_prefill_confirms(pair: Cluster) -> None:
    pages = [2, 3]
    send, recv = _start_slow_room(pair, 0x52, pages)
    t0 = time.monotonic()
    recv.abort("client went away")  # type: ignore[attr-defined]
    assert not recv.quiesced, "pages reusable while prefill may still write them"  # type: ignore[attr-defined]
    deadline = t0 + 3.0
    while not recv.quiesced:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "ReleaseRoom never confirmed"
        time.sleep(0.005)
    waited = time.monotonic() - t0
    _mark(pair, pages)  # now decode reuses them
    time.sleep(DELAY_MS / 1e3 + 0.3)
    assert _marked(pair, pages), "a prefill write landed after ReleaseRoom confirmed"
    assert waited < 3.0, "confirmed by the quarantine deadline, not by prefill"
    assert send.state is RoomState.ABORTED  # type: ignore[attr-defined]
    _drain(pair)


def test_release_before_prefill_starts_refuses_the_room(pair: Cluster) -> None:
    """Decode gave up before prefill's Generate arrived: prefill's sender starts aborted."""
    recv = pair.decode[0].manager.create_receiver(0x53, pair.bootstrap_addr, [4], num_tokens=3)
    recv.abort("deadline")
    deadline = time.monotonic() + 3.0
    while not recv.quiesced:
        assert time.monotonic() < deadline, "ReleaseRoom for an unknown room did not answer at once"
        time.sleep(0.005)
    send = pair.prefill[0].manager.create_sender(0x53)
    assert send.state is RoomState.ABORTED and "released by decode" in (send.error or "")
    _drain(pair)


def test_unreachable_prefill_quarantine_is_bounded() -> None:
    """Prefill gone: no confirmation can come; pages come back after transfer_timeout_s."""
    c = make_cluster(
        "mooncake", layout(), layout(), transfer_timeout_s=0.5, bootstrap_timeout_s=5.0
    )
    try:
        dead = c.prefill[0].addr
        c.prefill[0].server.stop(grace=None)  # type: ignore[union-attr]
        recv = c.decode[0].manager.create_receiver(0x54, dead, [0], num_tokens=3)
        t0 = time.monotonic()
        recv.abort("peer gone")
        assert not recv.quiesced
        while not recv.quiesced:
            assert time.monotonic() - t0 < 3.0, "quarantine not bounded by transfer_timeout_s"
            time.sleep(0.01)
        assert time.monotonic() - t0 >= 0.45
    finally:
        c.close()
