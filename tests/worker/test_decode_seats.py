"""Decode reserves a seat of the running batch together with the pages (backpressure): a
landed request never waits for a seat after its first token (scheduler role interface)."""

from __future__ import annotations

from tests.worker.factories import fake_run, make_request, make_scheduler, run_to_completion
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler


def _room(sched: Scheduler, n: int = 10) -> Request:
    req = make_request(n, max_tokens=3)
    sched.expect_remote(req)
    return req


def test_no_seat_no_reservation_even_with_free_pages() -> None:
    sched, _ = make_scheduler(num_pages=64, max_num_seqs=2)
    a, b, c = _room(sched), _room(sched), _room(sched)
    assert sched.reserve(a, 11) and sched.reserve(b, 11)
    assert sched.cache.num_free_pages > 3 * 8  # pages to spare: the seat is what is short
    assert not sched.reserve(c, 11)
    assert not c.page_table, "a refused reservation took pages"
    for req in (a, b):  # both land and take the seats they reserved
        assert sched.land(req, 5, None)
        assert sched.seat(req)
    assert [r.status for r in sched.running] == [RequestStatus.RUNNING] * 2
    assert not sched.reserve(c, 11)  # still full: running now
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))
    run_to_completion(sched)  # a and b finish and give their seats back
    assert sched.reserve(c, 11) and sched.land(c, 5, None) and sched.seat(c)
    run_to_completion(sched)
    sched.assert_drained()


def test_a_finished_reservation_gives_its_seat_back() -> None:
    sched, _ = make_scheduler(max_num_seqs=1)
    a, b = _room(sched), _room(sched)
    assert sched.reserve(a, 11) and not sched.reserve(b, 11)
    sched.finish(a, RequestStatus.FINISHED_ERROR, "room failed", "peer")  # its room died
    assert sched.reserve(b, 11)
    sched.finish(b, RequestStatus.FINISHED_ABORTED, "client left", "unavailable")
    sched.assert_drained()


def test_preempted_requests_go_before_new_reservations() -> None:
    """A request decode preempted (it has streamed tokens) waits to recompute; a new room must
    not take the seat it needs."""
    sched, _ = make_scheduler(max_num_seqs=2)
    a = _room(sched)
    assert sched.reserve(a, 11) and sched.land(a, 5, None) and sched.seat(a)
    sched.running.remove(a)  # as _preempt does: back to the waiting queue
    sched.cache.free(a)
    a.status, a.num_computed_tokens = RequestStatus.WAITING, 0
    sched.waiting.appendleft(a)
    b = _room(sched)
    assert not sched.reserve(b, 11)
    run_to_completion(sched)  # a recomputes and finishes
    assert sched.reserve(b, 11)
    sched.finish(b, RequestStatus.FINISHED_ABORTED, "done", "unavailable")
    sched.assert_drained()
