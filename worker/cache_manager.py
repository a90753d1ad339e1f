"""The KV cache manager: what the scheduler asks for room, and what the PD roles reserve.

One manager per scheduler (one per attention DP group). It owns the page pool and the prefix
cache (through `FullPages`) and one manager per other cache-group kind the model has
(worker/cache_groups.py), and answers in requests, never in pools:

- scheduler side: `match_prefix` (share a cached prefix, plan the bounded replay), `admit`
  (all of a request's holdings for its first chunk, or none), `grow` (pages for the next
  chunk), `chunk_limit` / `computed` (a state group's snapshot point), `chunk_cache` (where a
  chunk's rows go), `take_state_copies` (slot initialisations for the runner),
  `cache_computed`, `free`;
- role side (through the scheduler): `reserve` (decode: every holding a room lands in, all or
  nothing), `holdings` (prefill: what a room ships), `hold` / `release_hold` (decode's
  quarantine of an ended room's memory while a late write may still land), `hold_pages`
  (prefill: pages a room's queued writes will read);
- `stats` and `assert_drained` for load reports and tests.

Every holding is taken under the request's id in the group's ledger and given back exactly once
in `free` (finish, abort, failure, preemption); a hold adds a second holder name of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from worker.cache_groups import FullPages, StateSlots, WindowRings, WindowSpec
from worker.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkCache:
    """Where one chunk of a request reads and writes the groups other than its page table."""

    window_pages: list[int] = field(default_factory=list)  # its window ring, ring order
    window_from: int = 0  # first position whose ring rows are valid (a bounded replay's start)
    full_from: int = 0  # positions below keep their cached full-page KV (not written again)
    state_slot: int = -1  # its recurrent-state slot (-1 without a state group)


@dataclass(frozen=True)
class Holdings:
    """What a request holds, per group: what a PD room ships from or lands in."""

    page_table: list[int]
    window_ring: list[int]  # [] without a window group
    state_slot: int = -1  # -1 without a state group


@dataclass(frozen=True)
class CacheHold:
    """A second holder on a request's memory, past the request's own end (decode quarantine)."""

    holder: str  # the ledger's name for it, e.g. quarantine:<request id>
    pages: list[int]
    window_ring: list[int]
    state_slot: int = -1


@dataclass(frozen=True)
class CacheStats:
    used_pages: int  # held by live requests and holds (cached-only pages are not "used")
    total_pages: int
    cached_pages: int  # evictable: held only by the prefix cache
    window_used_pages: int  # ring pages held (hybrid models; else 0)
    state_used_slots: int = 0  # recurrent-state slots held by requests (snapshots not counted)


@dataclass(frozen=True)
class _Replay:
    """A prefix hit that restored full pages only: the suffix re-fed to rebuild the groups
    pages cannot restore (window rings from nothing, recurrent state from a snapshot)."""

    replay_from: int  # first position computed again
    full_from: int  # end of the hit: full pages below are not written again
    state_from: int = StateSlots.ZERO  # the snapshot slot holding the state at replay_from


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, *, prefix_cache: bool,
                 window: WindowSpec | None = None, num_window_pages: int = 0,
                 num_state_slots: int = 0, num_state_snapshots: int = 0,
                 hit_drops_last_page: bool = False) -> None:
        self.page_size = page_size
        # speculative eagle/mtp: a hit keeps all but its last page (worker/engine.py says why)
        self.full = FullPages(num_pages, page_size, prefix_cache, drop_last=hit_drops_last_page)
        self.window = WindowRings(window, num_window_pages) if window is not None else None
        self.state: StateSlots | None = None
        if num_state_slots:
            snapshots = num_state_snapshots if prefix_cache else 0
            self.state = StateSlots(num_state_slots, snapshots, page_size)
        self._replays: dict[str, _Replay] = {}

    # ---- capacity ----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.full.pool.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return self.full.pages_for(num_tokens)

    def window_tokens(self) -> int:
        """The window group's window in tokens; 0 without one."""
        return self.window.spec.window if self.window is not None else 0

    def max_drafts(self, k: int) -> int:
        """Drafts a verify step may write, at most `k`: a window group's rings spare fewer
        (WindowSpec.max_drafts); the scheduler keeps room for no more."""
        if self.window is None or k <= self.window.spec.max_drafts:
            return k
        log.info("speculative.num_speculative_tokens %d -> %d drafts a step: a window ring of "
                 "%d tokens (window %d) spares no more (raise cache.page_size for more)", k,
                 self.window.spec.max_drafts, self.window.spec.ring_pages * self.page_size,
                 self.window.spec.window)
        return self.window.spec.max_drafts

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
        if not hit or (self.window is None and self.state is None):
            return hit
        replay_from = hit
        if self.window is not None:
            replay_from = max(0, hit - self.window.spec.replay_tokens) // self.page_size
            replay_from *= self.page_size
        state_from = StateSlots.ZERO
        if self.state is not None:  # the state after replay_from must be a snapshot's
            replay_from, state_from = self.state.restore_point(req.all_token_ids(), replay_from)
        self._replays[req.request_id] = _Replay(replay_from, hit, state_from)
        return replay_from

    def cached_prefix(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` the prefix cache holds (full pages; a read only)."""
        cache = self.full.prefix_cache
        return cache.peek(token_ids) * self.page_size if cache is not None else 0

    def admit(self, req: Request, num_tokens: int) -> bool:
        """Everything a request needs to start: pages for `num_tokens` tokens and its fixed
        holdings (ring). Only when the whole remaining prompt could fit, so chunked prefill does
        not start what page pressure would preempt at once. False = nothing more was taken."""
        if self.pages_for(req.num_tokens) - len(req.page_table) > self.full.num_available:
            return False
        if not self._take_fixed(req, num_tokens):
            return False
        if self.state is not None:  # the slot starts from zeros, or from the hit's snapshot
            replay = self._replays.get(req.request_id)
            self.state.start(req.request_id, replay.state_from if replay else StateSlots.ZERO)
        return True

    def _take_fixed(self, req: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens plus one of each per-request holding, or nothing."""
        if self.window is not None and not self.window.can_take:
            return False
        if self.state is not None and not self.state.can_take:
            return False
        if not self.full.grow(req, num_tokens):
            return False
        if self.window is not None:
            self.window.take(req.request_id)
        if self.state is not None:
            self.state.take(req.request_id)
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for the request's first `num_tokens` tokens (its next chunk)."""
        return self.full.grow(req, num_tokens)

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Pages past the request's first `num_tokens` tokens go back (rejected drafts)."""
        self.full.shrink(req, num_tokens)

    def chunk_limit(self, req: Request, num_tokens: int) -> int:
        """How many of the next `num_tokens` tokens one chunk may take: with a state group a
        prompt chunk ends at the prompt's last page boundary, where its state is snapshotted."""
        if self.state is None or self.state.num_snapshots == 0:
            return num_tokens
        start, at = req.num_computed_tokens, self._snapshot_at(req)
        return at - start if start < at < start + num_tokens else num_tokens

    def _snapshot_at(self, req: Request) -> int:
        """The last page boundary before the prompt's end (0: the prompt is one page or less)."""
        return (req.num_prompt_tokens - 1) // self.page_size * self.page_size

    def computed(self, req: Request) -> None:
        """The request's tokens so far are computed: snapshot its state at the prompt's boundary."""
        if self.state is not None and req.num_computed_tokens == self._snapshot_at(req) > 0:
            self.state.snapshot(req.request_id, req.prompt_token_ids[: req.num_computed_tokens])

    def take_state_copies(self) -> list[tuple[int, int]]:
        """Slot copies (src or StateSlots.ZERO, dst) the runner applies before the next forward."""
        return self.state.take_copies() if self.state is not None else []

    def chunk_cache(self, req: Request) -> ChunkCache:
        if self.window is None and self.state is None:
            return ChunkCache()
        rid = req.request_id
        replay = self._replays.get(rid)
        return ChunkCache(window_pages=self.window.ring(rid) if self.window is not None else [],
                          window_from=replay.replay_from if replay else 0,
                          full_from=replay.full_from if replay else 0,
                          state_slot=self.state.slot(rid) if self.state is not None else -1)

    def cache_computed(self, req: Request) -> None:
        self.full.cache(req)

    def free(self, req: Request) -> None:
        """Give back everything the request holds (its computed pages stay cached)."""
        self.full.release(req)
        if self.window is not None:
            self.window.release(req.request_id)
        if self.state is not None:
            self.state.release(req.request_id)
        self._replays.pop(req.request_id, None)

    # ---- the roles' side -------------------------------------------------------------------------
    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Decode: every holding a room lands in, for `num_tokens` tokens, or nothing (prefill
        writes the state slot: it needs no initialisation here)."""
        return self._take_fixed(req, num_tokens)

    def holdings(self, req: Request) -> Holdings:
        rid = req.request_id
        ring = self.window.ring(rid) if self.window is not None else []
        slot = self.state.slot(rid) if self.state is not None else -1
        return Holdings(page_table=list(req.page_table), window_ring=list(ring), state_slot=slot)

    def hold(self, req: Request, holder: str) -> CacheHold:
        """Keep the request's memory past its end under `holder`."""
        held = self.holdings(req)
        self.full.pool.share(held.page_table, holder)
        if self.window is not None and held.window_ring:
            self.window.pool.share(held.window_ring, holder)
        if self.state is not None and held.state_slot >= 0:
            self.state.pool.share([held.state_slot], holder)
        return CacheHold(holder, held.page_table, held.window_ring, held.state_slot)

    def hold_pages(self, pages: list[int], holder: str) -> CacheHold:
        """Keep some of a request's full pages under `holder` (prefill: pages a room's sender
        reads later, which a preemption must not hand to another request meanwhile)."""
        self.full.pool.share(pages, holder)
        return CacheHold(holder, list(pages), [], -1)

    def release_hold(self, hold: CacheHold) -> None:
        self.full.pool.release(hold.pages, hold.holder)
        if self.window is not None and hold.window_ring:
            self.window.pool.release(hold.window_ring, hold.holder)
        if self.state is not None and hold.state_slot >= 0:
            self.state.pool.release([hold.state_slot], hold.holder)

    # ---- reports -------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        pool = self.full.pool
        return CacheStats(used_pages=pool.num_used, total_pages=pool.num_pages,
                          cached_pages=pool.num_cached,
                          window_used_pages=self.window.pool.num_used if self.window else 0,
                          state_used_slots=self.state.pool.num_used if self.state else 0)

    @property
    def num_free_pages(self) -> int:
        return self.full.pool.num_free

    def assert_drained(self) -> None:
        """No page of any group is held by a request or a hold (cached pages are fine)."""
        self.full.pool.assert_drained()
        if self.window is not None:
            self.window.assert_drained()
        if self.state is not None:
            self.state.assert_drained()
        assert not self._replays, f"replay records left: {sorted(self._replays)}"
