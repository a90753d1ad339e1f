"""Layer-wise transfer: pages handed to a room's sender stay held until the room ends.

A prompt's full pages leave every `transfer.layerwise_interval` chunks while it still computes;
the writes read them later (once decode registers, on the transfer thread). If the request is
preempted meanwhile, its pages go to the prefix cache, where eviction could hand them to another
request before the writes read them: decode would receive another prompt's KV in a room that
succeeds. Real transfer manager (fake backend, real gRPC bootstrap), real scheduler."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.worker.factories import fake_run, make_scheduler
from tests.worker.roles import prefill_role, with_room
from worker.prefill import PrefillRole
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler
from worker.step import SchedulePlan


@pytest.fixture
def role() -> Iterator[tuple[PrefillRole, str]]:
    with prefill_role(layerwise_interval=1) as prefill:
        yield prefill


def _preempted_after_two_pages(prefill: PrefillRole, addr: str
                               ) -> tuple[Scheduler, Request, list[int]]:
    """B's first chunk (8 of 20 tokens) fills two pages, which leave layer-wise; then B is
    preempted (page pressure: e.g. a hybrid model's chunk cut at its snapshot point lets a second
    prompt start beside it). Decode never registers, so every write is still queued."""
    sched, _ = make_scheduler(num_pages=8, page_size=4, chunked_prefill_size=8)
    sched.hooks = prefill
    b = with_room(2, addr, num_prompt_tokens=20)
    prefill.add_request(b, sched)
    plan = sched.schedule()
    sched.update(plan, fake_run(plan))
    prefill.after_step()
    sent = list(b.page_table[:2])
    sched._preempt(b, SchedulePlan())
    assert b.status is RequestStatus.WAITING and not b.page_table
    return sched, b, sent


def test_preempted_prompt_keeps_its_sent_pages_until_the_room_ends(
        role: tuple[PrefillRole, str]) -> None:
    prefill, addr = role
    sched, b, sent = _preempted_after_two_pages(prefill, addr)
    pool = sched.cache.full.pool
    # Before: B's sent page was only cached here, evictable under the very pressure that
    # preempted B.
    assert all(pool.holders_of(p) for p in sent), {p: pool.holders_of(p) for p in sent}
    prefill.abort(b.request_id, "client went away")
    sched.end(b.request_id, RequestStatus.FINISHED_ABORTED, "client went away", "unavailable")
    assert not any(pool.holders_of(p) for p in sent)  # the room's end gave the hold back
    sched.assert_drained()


def test_a_room_that_fails_gives_its_sent_pages_back(role: tuple[PrefillRole, str]) -> None:
    prefill, addr = role
    sched, b, sent = _preempted_after_two_pages(prefill, addr)
    prefill.manager.get(b.room).fail("decode went away")  # type: ignore[union-attr]
    prefill.poll()
    assert b.status is RequestStatus.FINISHED_ERROR and "decode went away" in b.error
    assert not any(sched.cache.full.pool.holders_of(p) for p in sent)
    sched.assert_drained()
