"""The per-kind managers of the KV cache manager (worker/cache_manager.py).

A cache group is a set of layers that keep their per-request state the same way; each kind has
a manager here that hands that state out and takes it back:

- `FullPages`: one page per `page_size` tokens, every token kept: the request's `page_table`.
  Computed full pages enter the prefix cache and are shared read-only by later requests.
  Full-attention K/V pages and MLA latent pages are both this kind: they differ only in what a
  page holds (worker/kv_cache.py), not in how pages are handed out.
- `WindowRings`: the sliding-window layers of a hybrid model keep only their last W tokens, in a
  ring of `ring_pages` pages per request (docs/hybrid-cache.md), taken whole and given back whole.

Each kind has its own `PagePool`, so its ledger names the holder of every page it handed out.
No manager knows about the scheduler or the roles; they call the KV cache manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.contract import ring_pages
from worker.page_pool import OutOfPages, PagePool
from worker.prefix_cache import PrefixCache
from worker.request import Request


class FullPages:
    """The request's `page_table`: pages for its tokens so far, shared through the prefix cache."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool,
                 drop_last: bool = False) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.prefix_cache = PrefixCache(self.pool, page_size) if prefix_cache else None
        self.drop_last = drop_last  # a hit leaves its last page to be recomputed

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available(self) -> int:
        """Pages a request could get now: free ones, plus cached ones the cache would evict."""
        cached = self.pool.num_cached if self.prefix_cache is not None else 0
        return self.pool.num_free + cached

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req.page_table` cover `num_tokens` tokens, evicting cached pages if needed."""
        need = self.pages_for(num_tokens) - len(req.page_table)
        if need <= 0:
            return True
        if need > self.pool.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.pool.num_free)
        try:
            req.page_table.extend(self.pool.allocate(need, req.request_id))
        except OutOfPages:
            return False
        return True

    def match(self, req: Request) -> int:
        """Share the longest cached prefix of the request's tokens; returns the tokens it covers.

        At least one token is left to compute: its logits give the next token.
        """
        if self.prefix_cache is None:
            return 0
        tokens = req.all_token_ids()
        pages = self.prefix_cache.match(tokens)
        while pages and len(pages) * self.page_size >= len(tokens):
            pages.pop()
        if self.drop_last and pages:
            pages.pop()
        self.pool.share(pages, req.request_id)
        req.page_table = list(pages)
        return len(pages) * self.page_size

    def cache(self, req: Request) -> None:
        """Record the request's computed full pages in the prefix cache."""
        if self.prefix_cache is not None and req.page_table:
            tokens = req.all_token_ids()[: req.num_computed_tokens]
            self.prefix_cache.insert(tokens, req.page_table)

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (rejected draft tokens')."""
        keep = self.pages_for(num_tokens)
        if len(req.page_table) > keep:
            self.pool.release(req.page_table[keep:], req.request_id)
            del req.page_table[keep:]

    def release(self, req: Request) -> None:
        if req.page_table:
            self.pool.release(req.page_table, req.request_id)
            req.page_table = []


@dataclass(frozen=True)
class WindowSpec:
    """The window group of a hybrid model, as the cache manager sees it."""

    window: int  # tokens a window layer attends to
    num_layers: int  # window layers (the bounded replay grows with their depth)
    page_size: int

    @property
    def ring_pages(self) -> int:
        return ring_pages(self.window, self.page_size)

    @property
    def max_drafts(self) -> int:
        """Drafts a verify step may write into the ring: the ring's R slots keep position p in
        slot p % R, so the draft at n + k overwrites n + k - R, which the next query (n + 1)
        still reads unless n + k - R < n + 2 - W. A rejected draft there would erase history."""
        return self.ring_pages * self.page_size - self.window + 1

    @property
    def replay_tokens(self) -> int:
        """Tokens before a prefix hit's end to re-feed so every ring row is rebuilt exactly.

        Window layer l's KV at token p depends on window layer l-1's output at p, which reads
        layer l-1's KV of tokens p-W+1..p: each window layer pushes the dependency W-1 tokens
        back, so the rows tokens after the hit will read need num_layers * (W-1) tokens replayed.
        """
        return self.num_layers * (self.window - 1)


class WindowRings:
    """One ring of window pages per request, from a pool of its own."""

    def __init__(self, spec: WindowSpec, num_pages: int) -> None:
        self.spec = spec
        self.pool = PagePool(num_pages)
        self._rings: dict[str, list[int]] = {}  # request id -> its ring, in ring order

    @property
    def can_take(self) -> bool:
        return self.pool.num_free >= self.spec.ring_pages

    def take(self, request_id: str) -> bool:
        """Give the request its ring unless it has one; False when the pool is short."""
        if request_id in self._rings:
            return True
        if not self.can_take:
            return False
        self._rings[request_id] = self.pool.allocate(self.spec.ring_pages, request_id)
        return True

    def ring(self, request_id: str) -> list[int]:
        """The request's ring ([] when it holds none)."""
        return self._rings.get(request_id, [])

    def release(self, request_id: str) -> None:
        ring = self._rings.pop(request_id, None)
        if ring is not None:
            self.pool.release(ring, request_id)

    def assert_drained(self) -> None:
        assert not self._rings, f"window rings still held: {sorted(self._rings)}"
        self.pool.assert_drained()


def page_keys(token_ids: list[int], page_size: int) -> list[int]:
    """A key per full page of `token_ids`, each chaining the ones before it: key k names the
    whole prefix of k + 1 pages, so equal keys mean equal prefixes (Python's hash of int tuples
    is stable within a process, which is all a snapshot key must be)."""
    keys, key = [], 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        key = hash((key, tuple(token_ids[start : start + page_size])))
        keys.append(key)
    return keys


class StateSlots:
    """Recurrent state (linear-attention layers): one fixed-size slot per request, plus snapshot
    slots that let a later request with the same prefix start from a page boundary.

    A request's slot must hold the state after its computed tokens whenever a chunk of it runs;
    the manager records how each slot must be initialised (zeroed, or copied from a snapshot)
    and the runner applies those copies before the next forward (`take_copies`). A snapshot is
    the state after a whole number of pages, keyed by the prefix it follows (`page_keys`), kept
    LRU under the holder `snapshot` until its slot is needed.
    """

    ZERO = -1  # a copy from ZERO clears the destination slot

    def __init__(self, num_slots: int, num_snapshots: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_snapshots = num_snapshots
        self.pool = PagePool(num_slots + num_snapshots)
        self._slots: dict[str, int] = {}  # request id -> its slot
        self._snapshots: dict[int, int] = {}  # prefix key -> snapshot slot, oldest first
        self._copies: list[tuple[int, int]] = []  # (src slot or ZERO, dst slot), in order

    @property
    def can_take(self) -> bool:
        return self.pool.num_free - self._spare_for_snapshots() > 0

    def _spare_for_snapshots(self) -> int:
        """Free slots kept back for snapshots, so requests never starve the snapshot cache."""
        return max(0, self.num_snapshots - len(self._snapshots))

    def take(self, request_id: str) -> bool:
        if request_id in self._slots:
            return True
        if not self.can_take:
            return False
        self._slots[request_id] = self.pool.allocate(1, request_id)[0]
        return True

    def slot(self, request_id: str) -> int:
        """The request's slot (-1 when it holds none)."""
        return self._slots.get(request_id, -1)

    def start(self, request_id: str, from_snapshot: int = ZERO) -> None:
        """The request's next chunk starts from `from_snapshot`'s state (ZERO: position 0)."""
        self._copies.append((from_snapshot, self._slots[request_id]))

    def restore_point(self, token_ids: list[int], limit: int) -> tuple[int, int]:
        """The longest snapshotted prefix of `token_ids` of at most `limit` tokens:
        (its length in tokens, its snapshot slot); (0, ZERO) when none."""
        keys = page_keys(token_ids[:limit], self.page_size)
        for k in range(len(keys) - 1, -1, -1):
            slot = self._snapshots.get(keys[k])
            if slot is not None:
                self._snapshots[keys[k]] = self._snapshots.pop(keys[k])  # most recently used
                return (k + 1) * self.page_size, slot
        return 0, self.ZERO

    def snapshot(self, request_id: str, token_ids: list[int]) -> None:
        """Keep the state the request's slot holds now (after `token_ids`, a whole number of
        pages) for later requests with that prefix."""
        key = page_keys(token_ids, self.page_size)[-1]
        if key in self._snapshots or self.num_snapshots == 0:
            return
        if len(self._snapshots) >= self.num_snapshots:
            oldest = next(iter(self._snapshots))
            self.pool.uncache(self._snapshots.pop(oldest))
        dst = self.pool.allocate(1, "snapshot")[0]
        self.pool.mark_cached(dst)
        self.pool.release([dst], "snapshot")  # cached: held by no request
        self._snapshots[key] = dst
        self._copies.append((self._slots[request_id], dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """The slot copies to apply before the next forward, in order (the runner's)."""
        copies, self._copies = self._copies, []
        return copies

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.pool.release([slot], request_id)
            # A copy into the slot that has not run yet must not land in its next owner's state.
            self._copies = [(s, d) for s, d in self._copies if d != slot]

    def assert_drained(self) -> None:
        assert not self._slots, f"state slots still held: {sorted(self._slots)}"
        self.pool.assert_drained()
