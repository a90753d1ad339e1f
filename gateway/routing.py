"""Routing policies: pick one worker of a pool for a request.

- `RoundRobin`: the next healthy worker in turn.
- `LeastLoad`: the lowest `Worker.load_score()` (running + waiting + the gateway's in-flight
  count + KV fraction); ties go round-robin so equal workers share a burst.
- `CacheAware` (prefill): the worker that most recently saw the longest prefix of this prompt,
  unless it is busier than the least-loaded worker by more than a threshold. Prefixes are
  remembered as a chain of page hashes (hash of the previous page's hash and this page's
  tokens), so a lookup walks the prompt once and memory is bounded by an LRU of page hashes.
  A prefill worker with attention DP keeps a room in group `room % groups`, each group with its
  own prefix cache: `group` names the group that last ran the prompt's longest prefix there,
  by the same load bound against the worker's groups (each group's reported queue and KV plus
  this gateway's requests in flight there), and the gateway draws the room in it (a session's
  turns stay where their pages are; a prefix every request shares spills over).

Policies see only candidate lists; they hold no reference to the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar


class Routable(Protocol):
    url: str

    def load_score(self) -> float: ...


W = TypeVar("W", bound=Routable)


class Policy(Protocol):
    def pick(self, candidates: Sequence[W], prompt_ids: Sequence[int]) -> W: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[W], prompt_ids: Sequence[int]) -> W:
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return w


class LeastLoad:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[W], prompt_ids: Sequence[int]) -> W:
        n = len(candidates)
        start = self._next % n
        self._next += 1
        best = candidates[start]
        best_score = best.load_score()
        for i in range(1, n):
            w = candidates[(start + i) % n]
            s = w.load_score()
            if s < best_score:
                best, best_score = w, s
        return best


def least_loaded(loads: Sequence[float], start: int) -> int:
    """The index of the lowest load; ties go to the first from `start` on (a rotation)."""
    n = len(loads)
    best = start % n
    for i in range(1, n):
        j = (start + i) % n
        if loads[j] < loads[best]:
            best = j
    return best


def page_hashes(prompt_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the prompt's full pages: equal hash at i = equal prefix up to page i."""
    out: list[int] = []
    h = 0
    for i in range(0, len(prompt_ids) - page_size + 1, page_size):
        h = hash((h, *prompt_ids[i : i + page_size]))
        out.append(h)
    return out


class CacheAware:
    """Longest remembered prefix wins, balanced against load."""

    def __init__(
        self, page_size: int = 16, max_pages: int = 200_000, load_threshold: float = 8.0
    ) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.load_threshold = load_threshold
        # page hash -> (url of the last worker sent it, its DP group there; -1: none or unknown)
        self._owner: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._least = LeastLoad()

    def pick(self, candidates: Sequence[W], prompt_ids: Sequence[int]) -> W:
        hashes = page_hashes(prompt_ids, self.page_size)
        by_url = {w.url: w for w in candidates}
        best: W | None = None
        for h in hashes:  # walk down the chain; the deepest page owned by a candidate wins
            owner = self._owner.get(h)
            if owner is None:
                break
            w = by_url.get(owner[0])
            if w is not None:
                best = w
        least = self._least.pick(candidates, prompt_ids)
        if best is None or best.load_score() - least.load_score() > self.load_threshold:
            best = least
        self._remember(hashes, best.url)
        return best

    def group(self, url: str, prompt_ids: Sequence[int], loads: Sequence[float],
              fresh: int) -> int:
        """The DP group of worker `url` (`loads`: one per group) that last ran the prompt's
        longest remembered prefix there, unless it is busier than the least-loaded group by more
        than the threshold; else the least-loaded group (ties: `fresh` first). Remembered for
        the prompt's pages."""
        hashes = page_hashes(prompt_ids, self.page_size)
        owned = -1
        for h in hashes:
            owner = self._owner.get(h)
            if owner is None:
                break
            if owner[0] == url and 0 <= owner[1] < len(loads):
                owned = owner[1]
        least = least_loaded(loads, fresh)
        within = owned >= 0 and loads[owned] - loads[least] <= self.load_threshold
        chosen = owned if within else least
        self._remember(hashes, url, chosen)
        return chosen

    def _remember(self, hashes: list[int], url: str, group: int = -1) -> None:
        """`url` ran these pages, in `group` (-1: a page keeps the group it had at `url`)."""
        owner = self._owner
        for h in hashes:
            old = owner.get(h)
            keep = old[1] if old is not None and old[0] == url else -1
            owner[h] = (url, group if group >= 0 else keep)
            owner.move_to_end(h)
        while len(owner) > self.max_pages:
            owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owner)
