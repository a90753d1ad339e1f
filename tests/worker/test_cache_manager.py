"""The KV cache manager on its own: no model, no scheduler, only requests and ledgers."""

from __future__ import annotations

import pytest

from tests.worker.factories import make_request
from worker.cache_groups import WindowSpec
from worker.cache_manager import KVCacheManager

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
