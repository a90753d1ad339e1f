"""The KV cache manager on its own: no model, no scheduler, only requests and ledgers."""

from __future__ import annotations

import pytest

from tests.worker.factories import make_request
from worker.cache_groups import StateSlots, WindowSpec
from worker.cache_manager import KVCacheManager
from worker.request import Request

PAGE = 4


def manager(num_pages: int = 8, *, window: int = 0, rings: int = 2,
            prefix_cache: bool = True) -> KVCacheManager:
    spec = WindowSpec(window, num_layers=2, page_size=PAGE) if window else None
    ring_pages = spec.ring_pages if spec else 0
    return KVCacheManager(num_pages, PAGE, prefix_cache=prefix_cache, window=spec,
                          num_window_pages=ring_pages * rings)


def test_admit_takes_everything_or_nothing() -> None:
    cache = manager(num_pages=4, window=6, rings=1)  # one ring of 3 pages
    a, b = make_request(8), make_request(8)
    assert cache.admit(a, 8)
    assert len(a.page_table) == 2 and len(cache.holdings(a).window_ring) == 3
    assert not cache.admit(b, 8)  # pages would fit, the only ring is taken
    assert b.page_table == [] and cache.holdings(b).window_ring == []
    cache.free(a)
    assert cache.admit(b, 8)
    cache.free(b)
    cache.assert_drained()


def test_admit_refuses_a_prompt_that_could_not_finish_and_fits_says_why() -> None:
    cache = manager(num_pages=4)
    long = make_request(20)  # 5 pages: never fits
    assert not cache.fits(long.num_tokens)
    assert not cache.admit(long, 4) and long.page_table == []
    cache.assert_drained()


def test_grow_evicts_cached_pages_and_free_keeps_computed_pages_cached() -> None:
    cache = manager(num_pages=4)
    a = make_request(16)
    assert cache.admit(a, 16)
    a.num_computed_tokens = 16
    cache.cache_computed(a)
    cache.free(a)
    assert cache.stats().cached_pages == 4 and cache.stats().used_pages == 0
    b = make_request(16, prompt=[99] * 16)  # shares nothing: every cached page is evicted
    assert cache.admit(b, 16)
    assert cache.stats().cached_pages == 0 and cache.stats().used_pages == 4
    cache.free(b)
    cache.assert_drained()


def test_prefix_hit_with_a_window_replays_a_page_aligned_bounded_suffix() -> None:
    cache = manager(num_pages=32, window=3)  # replay_tokens = 2 layers * (3 - 1) = 4
    first = make_request(40)
    assert cache.admit(first, 40)
    first.num_computed_tokens = 40
    cache.cache_computed(first)
    cache.free(first)
    again = make_request(prompt=first.prompt_token_ids + [7])
    computed = cache.match_prefix(again)
    assert computed == 40 - 4 and computed % PAGE == 0
    assert cache.admit(again, again.num_tokens)
    where = cache.chunk_cache(again)
    assert (where.window_from, where.full_from) == (36, 40)
    assert len(where.window_pages) == WindowSpec(3, 2, PAGE).ring_pages
    cache.free(again)
    assert cache.chunk_cache(again).full_from == 0  # the replay record went with the request
    cache.assert_drained()


def test_a_hit_leaves_one_token_to_compute() -> None:
    cache = manager(num_pages=8)
    a = make_request(8)
    assert cache.admit(a, 8)
    a.num_computed_tokens = 8
    cache.cache_computed(a)
    cache.free(a)
    same = make_request(prompt=a.prompt_token_ids)
    assert cache.match_prefix(same) == 4  # the last full page is recomputed for its logits
    cache.free(same)
    cache.assert_drained()


def test_reserve_is_all_or_nothing_and_evicts_cached_pages() -> None:
    cache = manager(num_pages=4, window=6, rings=1)
    cached = make_request(16)
    assert cache.admit(cached, 16)
    cached.num_computed_tokens = 16
    cache.cache_computed(cached)
    cache.free(cached)  # 4 cached pages, the ring back in its pool
    room = make_request(15)
    assert cache.reserve(room, 16)  # evicts what it needs
    other = make_request(3)
    assert not cache.reserve(other, 4)  # no page and no ring left: nothing taken
    assert other.page_table == [] and cache.holdings(other).window_ring == []
    cache.free(room)
    cache.assert_drained()


def test_a_hold_keeps_memory_past_the_request_and_the_ledger_names_it() -> None:
    cache = manager(num_pages=8, window=6)
    req = make_request(8)
    assert cache.reserve(req, 9)
    hold = cache.hold(req, f"quarantine:{req.request_id}")
    cache.free(req)
    assert cache.stats().used_pages == 3 and cache.stats().window_used_pages == 3
    with pytest.raises(AssertionError, match=f"quarantine:{req.request_id}"):
        cache.assert_drained()
    cache.release_hold(hold)
    cache.assert_drained()


def test_free_twice_gives_back_nothing_more() -> None:
    cache = manager(num_pages=8, window=6)
    req = make_request(8)
    assert cache.admit(req, 8)
    cache.free(req)
    cache.free(req)  # finish after an abort path already freed it: nothing held, no error
    cache.assert_drained()


def state_manager(num_pages: int = 32, slots: int = 2, snapshots: int = 2) -> KVCacheManager:
    return KVCacheManager(num_pages, PAGE, prefix_cache=True, num_state_slots=slots,
                          num_state_snapshots=snapshots)


def _run_prompt(cache: KVCacheManager, req: Request) -> None:
    """What the scheduler does for a prompt: chunks up to the manager's limit, then done."""
    while req.num_computed_tokens < req.num_prompt_tokens:
        n = cache.chunk_limit(req, req.num_prompt_tokens - req.num_computed_tokens)
        assert cache.grow(req, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        cache.computed(req)
    cache.cache_computed(req)


def test_state_slot_starts_from_zeros_and_the_prompt_is_snapshotted_at_its_last_boundary() -> None:
    cache = state_manager()
    req = make_request(10)  # pages of 4: the snapshot point is 8
    assert cache.admit(req, 4)
    slot = cache.chunk_cache(req).state_slot
    assert slot >= 0 and cache.take_state_copies() == [(StateSlots.ZERO, slot)]
    assert cache.chunk_limit(req, 10) == 8  # a chunk ends where the snapshot is taken
    _run_prompt(cache, req)
    ((src, snap),) = cache.take_state_copies()  # the slot's state after 8 tokens, kept
    assert src == slot and snap != slot
    cache.free(req)
    assert cache.stats().state_used_slots == 0  # the snapshot is cached, not used
    cache.assert_drained()


def test_a_prefix_hit_restores_the_snapshot_and_replays_from_it() -> None:
    cache = state_manager()
    first = make_request(10)
    assert cache.admit(first, 10)
    _run_prompt(cache, first)
    snap = cache.take_state_copies()[-1][1]
    cache.free(first)
    again = make_request(prompt=first.prompt_token_ids[:9] + [77, 78, 79])
    assert cache.match_prefix(again) == 8  # the hit (8 tokens of pages) ends at the snapshot
    assert cache.admit(again, again.num_tokens)
    where = cache.chunk_cache(again)
    assert cache.take_state_copies() == [(snap, where.state_slot)]
    assert (where.window_from, where.full_from) == (8, 8)
    cache.free(again)
    cache.assert_drained()


def test_without_a_snapshot_a_hit_replays_from_zero_and_writes_no_full_page() -> None:
    cache = state_manager(snapshots=0)  # prefix cache on, but no state snapshots
    first = make_request(12)
    assert cache.admit(first, 12)
    _run_prompt(cache, first)
    cache.free(first)
    again = make_request(prompt=first.prompt_token_ids + [5])
    assert cache.match_prefix(again) == 0
    assert cache.admit(again, again.num_tokens)
    assert cache.chunk_cache(again).full_from == 12  # replayed tokens' pages stay shared
    cache.free(again)
    cache.assert_drained()


def test_snapshots_are_evicted_oldest_first_and_requests_never_take_their_slots() -> None:
    cache = state_manager(slots=1, snapshots=1)
    a, b = make_request(9), make_request(prompt=[50 + i for i in range(9)])
    for req in (a, b):
        assert cache.admit(req, req.num_tokens)
        _run_prompt(cache, req)
        cache.free(req)
    cache.take_state_copies()
    miss, hit = (make_request(prompt=r.prompt_token_ids + [1]) for r in (a, b))
    assert cache.match_prefix(miss) == 0  # a's snapshot was evicted for b's
    assert cache.match_prefix(hit) == 8
    cache.free(miss)
    cache.free(hit)
    c, d = make_request(3), make_request(3)
    assert cache.admit(c, 3) and not cache.admit(d, 3)  # one request slot; the other is kept
    cache.free(c)
    cache.assert_drained()


def test_a_freed_slot_drops_its_pending_initialisation_and_holds_keep_the_slot() -> None:
    cache = state_manager()
    req = make_request(6)
    assert cache.admit(req, 6)
    cache.free(req)  # aborted before any step ran
    assert cache.take_state_copies() == []
    room = make_request(6)
    assert cache.reserve(room, 7)
    hold = cache.hold(room, "quarantine:x")
    cache.free(room)
    assert cache.stats().state_used_slots == 1
    cache.release_hold(hold)
    cache.assert_drained()
