"""The KV page pool and its ledger: who holds which page.

A page is either free, held by one or more live requests (refcount > 0: "used"), or held only
by the prefix cache (refcount 0 but present in the cache: "cached", evictable). The ledger keeps
the set of holders per page so that a leak names its culprit (`holders_of`, `assert_drained`).
"""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be satisfied; the caller decides to wait or preempt."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._holders: list[set[str]] = [
            set() for _ in range(num_pages)
        ]  # ledger: page -> request ids
        self._cached: set[int] = set()  # pages the prefix cache retains
        self._num_used = 0  # pages with at least one holder
        self._num_idle = 0  # cached pages with no holder (evictable): num_cached, in O(1)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages held by live requests (cached-only pages are not counted)."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Pages retained only by the prefix cache: evictable."""
        return self._num_idle

    def holders_of(self, page: int) -> frozenset[str]:
        return frozenset(self._holders[page])

    def is_held(self, page: int) -> bool:
        return bool(self._holders[page])

    # ---- holding ---------------------------------------------------------------------------
    def allocate(self, n: int, holder: str) -> list[int]:
        """Take `n` free pages for `holder`. All or nothing."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._hold(p, holder)
        return pages

    def share(self, pages: list[int], holder: str) -> None:
        """Add `holder` to pages that already hold data (prefix-cache hits)."""
        for p in pages:
            assert p in self._cached or self._holders[p], f"page {p} is free, cannot be shared"
            self._hold(p, holder)

    def release(self, pages: list[int], holder: str) -> None:
        """Drop `holder` from `pages`; a page with no holder and no cache entry becomes free."""
        for p in pages:
            holders = self._holders[p]
            assert holder in holders, (
                f"page {p} is not held by {holder!r} (holders: {sorted(holders)})"
            )
            holders.remove(holder)
            if not holders:
                self._num_used -= 1
                if p in self._cached:
                    self._num_idle += 1
                else:
                    self._free.append(p)

    def _hold(self, page: int, holder: str) -> None:
        holders = self._holders[page]
        assert holder not in holders, f"page {page} already held by {holder!r}"
        if not holders:
            self._num_used += 1
            if page in self._cached:
                self._num_idle -= 1
        holders.add(holder)

    # ---- the prefix cache's side ----------------------------------------------------------------
    def mark_cached(self, page: int) -> None:
        assert self._holders[page], f"page {page} must hold data before it is cached"
        self._cached.add(page)

    def uncache(self, page: int) -> None:
        """The cache dropped `page`; it becomes free unless a request still holds it."""
        if page not in self._cached:
            return
        self._cached.remove(page)
        if not self._holders[page]:
            self._num_idle -= 1
            self._free.append(page)

    def assert_drained(self) -> None:
        """No page is held by a request (cached pages are fine). For tests and drain checks."""
        leaked = {p: sorted(h) for p, h in enumerate(self._holders) if h}
        assert not leaked, f"pages still held: {leaked}"
        assert self._num_idle == len(self._cached), "idle cached pages miscounted"
        assert self.num_free + len(self._cached) == self.num_pages, (
            "free list and cache do not add up"
        )
