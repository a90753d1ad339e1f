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

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.prefix_cache = PrefixCache(self.pool, page_size) if prefix_cache else None

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
        self.pool.share(pages, req.request_id)
        req.page_table = list(pages)
        return len(pages) * self.page_size

    def cache(self, req: Request) -> None:
        """Record the request's computed full pages in the prefix cache."""
        if self.prefix_cache is not None and req.page_table:
            tokens = req.all_token_ids()[: req.num_computed_tokens]
            self.prefix_cache.insert(tokens, req.page_table)

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
