"""The KV cache manager: what the scheduler asks for room, and what the PD roles reserve.

One manager per scheduler (one per attention DP group). It owns the page pool and the prefix
cache (through `FullPages`) and one manager per other cache-group kind the model has
(worker/cache_groups.py), and answers in requests, never in pools:

- scheduler side: `match_prefix` (share a cached prefix, plan the bounded replay), `admit`
  (all of a request's holdings for its first chunk, or none), `grow` (pages for the next
  chunk), `chunk_cache` (where a chunk's rows go), `cache_computed`, `free`;
- role side (through the scheduler): `reserve` (decode: every holding a room lands in, all or
  nothing), `holdings` (prefill: what a room ships), `hold` / `release_hold` (decode's
  quarantine of an ended room's memory while a late write may still land);
- `stats` and `assert_drained` for load reports and tests.

Every holding is taken under the request's id in the group's ledger and given back exactly once
in `free` (finish, abort, failure, preemption); a hold adds a second holder name of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.cache_groups import FullPages, WindowRings, WindowSpec
from worker.request import Request


@dataclass(frozen=True)
class ChunkCache:
    """Where one chunk of a request reads and writes the groups other than its page table."""

    window_pages: list[int] = field(default_factory=list)  # its window ring, ring order
    window_from: int = 0  # first position whose ring rows are valid (a bounded replay's start)
    full_from: int = 0  # positions below keep their cached full-page KV (not written again)


@dataclass(frozen=True)
class Holdings:
    """What a request holds, per group: what a PD room ships from or lands in."""

    page_table: list[int]
    window_ring: list[int]  # [] without a window group


@dataclass(frozen=True)
class CacheHold:
    """A second holder on a request's memory, past the request's own end (decode quarantine)."""

    holder: str  # the ledger's name for it, e.g. quarantine:<request id>
    pages: list[int]
    window_ring: list[int]


@dataclass(frozen=True)
class CacheStats:
    used_pages: int  # held by live requests and holds (cached-only pages are not "used")
    total_pages: int
    cached_pages: int  # evictable: held only by the prefix cache
    window_used_pages: int  # ring pages held (hybrid models; else 0)


@dataclass(frozen=True)
class _Replay:
    """A prefix hit that restored full pages only: the suffix re-fed to rebuild the rings."""

    window_from: int
    full_from: int


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool,
                 window: WindowSpec | None = None, num_window_pages: int = 0) -> None:
        self.page_size = page_size
        self.full = FullPages(num_pages, page_size, prefix_cache)
        self.window = WindowRings(window, num_window_pages) if window is not None else None
        self._replays: dict[str, _Replay] = {}

    # ---- capacity ----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.full.pool.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return self.full.pages_for(num_tokens)

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens could ever be held by this cache."""
        return self.pages_for(num_tokens) <= self.num_pages

    # ---- the scheduler's side --------------------------------------------------------------------
    def match_prefix(self, req: Request) -> int:
        """Share the request's longest cached prefix; returns the tokens it need not compute.

        With a window group the tree restores full pages only, so the request re-feeds a bounded
        suffix of the hit (page-aligned, so cached_tokens stays a multiple of the page size): the
        replayed tokens write no full page (theirs sit in shared cached pages) and rebuild the
        ring exactly.
        """
        hit = self.full.match(req)
        if self.window is None or not hit:
            return hit
        replay_from = max(0, hit - self.window.spec.replay_tokens) // self.page_size
        replay_from *= self.page_size
        self._replays[req.request_id] = _Replay(window_from=replay_from, full_from=hit)
        return replay_from

    def admit(self, req: Request, num_tokens: int) -> bool:
        """Everything a request needs to start: pages for `num_tokens` tokens and its fixed
        holdings (ring). Only when the whole remaining prompt could fit, so chunked prefill does
        not start what page pressure would preempt at once. False = nothing more was taken."""
        if self.pages_for(req.num_tokens) - len(req.page_table) > self.full.num_available:
            return False
        if self.window is not None and not self.window.can_take:
            return False
        if not self.full.grow(req, num_tokens):
            return False
        if self.window is not None:
            self.window.take(req.request_id)
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for the request's first `num_tokens` tokens (its next chunk)."""
        return self.full.grow(req, num_tokens)

    def chunk_cache(self, req: Request) -> ChunkCache:
        if self.window is None:
            return ChunkCache()
        rid = req.request_id
        replay = self._replays.get(rid)
        return ChunkCache(window_pages=self.window.ring(rid),
                          window_from=replay.window_from if replay else 0,
                          full_from=replay.full_from if replay else 0)

    def cache_computed(self, req: Request) -> None:
        self.full.cache(req)

    def free(self, req: Request) -> None:
        """Give back everything the request holds (its computed pages stay cached)."""
        self.full.release(req)
        if self.window is not None:
            self.window.release(req.request_id)
        self._replays.pop(req.request_id, None)

    # ---- the roles' side ---------------------------------------------------------------------------
    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Decode: every holding a room lands in, for `num_tokens` tokens, or nothing."""
        if self.window is not None and not self.window.can_take:
            return False
        if not self.full.grow(req, num_tokens):
            return False
        if self.window is not None:
            self.window.take(req.request_id)
        return True

    def holdings(self, req: Request) -> Holdings:
        ring = self.window.ring(req.request_id) if self.window is not None else []
        return Holdings(page_table=list(req.page_table), window_ring=list(ring))

    def hold(self, req: Request, holder: str) -> CacheHold:
        """Keep the request's memory past its end under `holder`."""
        held = self.holdings(req)
        self.full.pool.share(held.page_table, holder)
        if self.window is not None and held.window_ring:
            self.window.pool.share(held.window_ring, holder)
        return CacheHold(holder, held.page_table, held.window_ring)

    def release_hold(self, hold: CacheHold) -> None:
        self.full.pool.release(hold.pages, hold.holder)
        if self.window is not None and hold.window_ring:
            self.window.pool.release(hold.window_ring, hold.holder)

    # ---- reports -------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        pool = self.full.pool
        return CacheStats(used_pages=pool.num_used, total_pages=pool.num_pages,
                          cached_pages=pool.num_cached,
                          window_used_pages=self.window.pool.num_used if self.window else 0)

    @property
    def num_free_pages(self) -> int:
        return self.full.pool.num_free

    def assert_drained(self) -> None:
        """No page of any group is held by a request or a hold (cached pages are fine)."""
        self.full.pool.assert_drained()
        if self.window is not None:
            self.window.assert_drained()
        assert not self._replays, f"replay records left: {sorted(self._replays)}"
