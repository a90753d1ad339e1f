"""The radix prefix cache's eviction: least recently used unheld leaves first, a parent once its
children are gone, never a page a live request holds; and the pool's O(1) count of evictable
pages stays equal to the count it replaced."""

from __future__ import annotations

import random

from worker.page_pool import PagePool
from worker.prefix_cache import PrefixCache

PAGE = 4


def _prompt(rng: random.Random, shared: list[int]) -> list[int]:
    """A prompt that may share a prefix with an earlier one (so the tree branches)."""
    keep = rng.randrange(0, len(shared) // PAGE + 1) * PAGE if shared else 0
    return shared[:keep] + [rng.randrange(50) for _ in range(rng.randrange(1, 6) * PAGE)]


def _leaves(cache: PrefixCache) -> list:
    return [n for n in cache._walk() if not n.children]  # noqa: SLF001 (the test's oracle)


def test_eviction_is_lru_over_unheld_leaves_and_counts_match() -> None:
    rng = random.Random(7)
    pool = PagePool(400)
    cache = PrefixCache(pool, PAGE)
    live: dict[str, list[int]] = {}  # request -> its pages
    prompts: list[list[int]] = []
    for step in range(1500):
        op = rng.random()
        if op < 0.45 or not live:  # a request arrives: prefix hit, fresh pages, cached
            tokens = _prompt(rng, rng.choice(prompts) if prompts else [])
            rid = f"r{step}"
            hit = cache.match(tokens)
            while hit and len(hit) * PAGE >= len(tokens):
                hit.pop()
            pool.share(hit, rid)
            need = len(tokens) // PAGE - len(hit)
            if need > pool.num_free:
                cache.evict(need - pool.num_free)
            if need > pool.num_free:
                pool.release(hit, rid)
                continue
            pages = hit + pool.allocate(need, rid)
            cache.insert(tokens, pages)
            live[rid] = pages
            prompts.append(tokens)
        elif op < 0.8:  # a request ends
            rid = rng.choice(sorted(live))
            pool.release(live.pop(rid), rid)
        else:  # evict one page: it must be the oldest leaf no request holds
            candidates = [n for n in _leaves(cache) if not pool.is_held(n.page)]
            before = {n.page for n in cache._walk()}  # noqa: SLF001
            freed = cache.evict(1)
            gone = before - {n.page for n in cache._walk()}  # noqa: SLF001
            assert freed == len(gone) == (1 if candidates else 0)
            if candidates:
                (page,) = gone
                oldest = min(n.last_used for n in candidates)
                assert {n.page for n in candidates if n.last_used == oldest} >= {page}
        idle = sum(1 for n in cache._walk() if not pool.is_held(n.page))  # noqa: SLF001
        assert pool.num_cached == idle
    for rid, pages in live.items():
        pool.release(pages, rid)
    cached = cache.num_pages
    assert cache.evict(10_000) == cached and cache.num_pages == 0
    pool.assert_drained()
    assert pool.num_free == pool.num_pages


def test_held_leaves_wait_and_parents_follow_their_children() -> None:
    pool = PagePool(16)
    cache = PrefixCache(pool, PAGE)
    a = list(range(3 * PAGE))  # three pages: root -> a0 -> a1 -> a2
    pages = pool.allocate(3, "a")
    cache.insert(a, pages)
    b_pages = pool.allocate(1, "b")
    cache.insert([99] * PAGE, b_pages)  # another branch, used after a
    pool.release(b_pages, "b")
    assert cache.evict(1) == 1 and cache.num_pages == 3  # a's pages are held: b goes
    pool.release(pages, "a")
    cache.match(a)  # a used again
    assert cache.evict(2) == 2 and cache.num_pages == 1  # a2, then its parent a1
    assert cache.match(a) == pages[:1]
    assert cache.evict(5) == 1 and cache.num_pages == 0
    pool.assert_drained()


def test_a_leaf_used_again_is_evicted_after_older_ones() -> None:
    pool = PagePool(8)
    cache = PrefixCache(pool, PAGE)
    first, second = [1] * PAGE, [2] * PAGE
    for tokens, rid in ((first, "a"), (second, "b")):
        pages = pool.allocate(1, rid)
        cache.insert(tokens, pages)
        pool.release(pages, rid)
    cache.match(first)  # first is now the more recently used
    assert cache.evict(1) == 1
    assert cache.match(first) != [] and cache.match(second) == []
