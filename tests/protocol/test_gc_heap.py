"""freeze_startup_heap: what is alive when a process is ready is out of every collection's
reach, and young collections are spaced out."""

from __future__ import annotations

import gc

from protocol.gc_heap import YOUNG_THRESHOLD, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector could ever free it


def test_the_startup_heap_is_frozen_and_young_collections_spaced() -> None:
    before = gc.get_threshold()
    kept = _Node()
    try:
        freeze_startup_heap()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
        # frozen: no generation holds it, so no collection traverses it
        assert not any(o is kept for o in gc.get_objects())
        later = _Node()  # made after the freeze: collected as ever
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()  # this test process goes on as it was
        gc.set_threshold(*before)
