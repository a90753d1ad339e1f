"""A page-granular radix prefix cache with LRU eviction.

Each node of the tree stands for one full page of tokens: its key is that page's token ids,
its value the page id holding their KV. A prompt's longest cached prefix is a walk from the
root. Only full pages enter the tree, so a cached page is never written again (the request
that made it has moved past it) and may be shared read-only by any number of requests.

Eviction drops least-recently-used leaves whose page no live request holds. The candidates
live in a heap keyed by last use, invalidated lazily (an entry is stale once its node was
touched again, gained a child or left the tree), so an eviction costs O(log n) per page instead
of a walk of the whole tree: with the cache full, every page a running request grows into
evicts one, and a walk per eviction took a quarter of the engine thread at batch 160.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.page_pool import PagePool


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]  # this page's token ids (page_size of them); () for the root
    page: int  # -1 for the root
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0
    in_tree: bool = True


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._root = _Node(key=(), page=-1, parent=None)
        self._clock = itertools.count(1)  # logical time for LRU
        self._num_nodes = 0
        # (last_used, tiebreak, node) of leaves, oldest first; stale entries are skipped
        self._lru: list[tuple[int, int, _Node]] = []
        self._tiebreak = itertools.count()

    @property
    def num_pages(self) -> int:
        return self._num_nodes

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Pages holding the longest cached prefix of `token_ids`, in order (full pages only)."""
        node, pages = self._root, []
        now = next(self._clock)
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            child = node.children.get(tuple(token_ids[start : start + self.page_size]))
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        if pages and not node.children:
            self._push(node)
        return pages

    def peek(self, token_ids: Sequence[int]) -> int:
        """How many leading full pages of `token_ids` the tree holds. A read only (no LRU
        touch, nothing shared): for choosing where a request goes, before it is admitted."""
        node, num = self._root, 0
        for start in range(0, len(token_ids) - self.page_size + 1, self.page_size):
            child = node.children.get(tuple(token_ids[start : start + self.page_size]))
            if child is None:
                break
            num += 1
            node = child
        return num

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Record that `pages` hold the KV of `token_ids` (its full pages are cached).

        Where the tree already has a page for the same tokens (another request computed them
        too), the existing one is kept and the caller's duplicate stays private to it.
        """
        node = self._root
        now = next(self._clock)
        num_full = min(len(token_ids) // self.page_size, len(pages))
        for i in range(num_full):
            key = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            child = node.children.get(key)
            if child is None:
                child = _Node(key=key, page=pages[i], parent=node)
                node.children[key] = child
                self.pool.mark_cached(pages[i])
                self._num_nodes += 1
            child.last_used = now
            node = child
        if node is not self._root and not node.children:
            self._push(node)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages no request holds, least recently used leaves first."""
        freed, held = 0, []
        lru = self._lru
        while freed < num_pages and lru:
            entry = heapq.heappop(lru)
            used, _, node = entry
            if not node.in_tree or node.children or node.last_used != used:
                continue  # stale: a fresher entry exists, or it is no longer a leaf
            if self.pool.is_held(node.page):
                held.append(entry)  # a live request's page: a candidate again once released
                continue
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not None and parent is not self._root and not parent.children:
                self._push(parent)  # a leaf now
        for entry in held:
            heapq.heappush(lru, entry)
        return freed

    def _push(self, node: _Node) -> None:
        lru = self._lru
        heapq.heappush(lru, (node.last_used, next(self._tiebreak), node))
        if len(lru) > 4 * self._num_nodes + 64:  # mostly stale: rebuild from the leaves
            self._lru = [(n.last_used, next(self._tiebreak), n) for n in self._leaves()]
            heapq.heapify(self._lru)

    def clear(self) -> None:
        """Drop every entry (pages still held by requests stay with them)."""
        for node in list(self._walk()):
            self.pool.uncache(node.page)
        self._root.children.clear()
        self._num_nodes = 0
        self._lru = []

    def _remove(self, leaf: _Node) -> None:
        assert leaf.parent is not None and not leaf.children
        del leaf.parent.children[leaf.key]
        leaf.in_tree = False
        self.pool.uncache(leaf.page)
        self._num_nodes -= 1

    def _walk(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[_Node]:
        return [n for n in self._walk() if not n.children]
