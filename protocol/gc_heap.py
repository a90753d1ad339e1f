"""The garbage collector in a serving process: the startup heap frozen once ready.

A worker or gateway allocates most of its objects once, at startup (modules, the model's
parameters and their Python wrappers, the app's routes and schemas, protobuf descriptors), and
keeps them for its whole life. CPython's full collections would still traverse all of them,
stopping every thread of the process: a gateway under `bench.gateway`'s load ran one or two a
run, 28 and 70 ms in all, and a worker's took 30-190 ms each on the 2-core dev box.
`freeze_startup_heap` collects once and moves what survives to the permanent generation, which
no collection traverses (the same load's full collections then took 0.7 ms in all).

Serving allocates and frees its objects by reference counting; the young collections only
find the few cycles it leaves, yet at CPython's default threshold (700 net allocations) the
gateway ran one every ~20 requests (13-26 ms a run). YOUNG_THRESHOLD lets a burst of requests
in flight pass without one (none in the same run). Refcounting still frees a frozen object
that is dropped; only a frozen cycle dropped later stays (a removed worker's few objects).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 7000  # net allocations between young collections (CPython's default: 700)


def freeze_startup_heap() -> None:
    """Collect, freeze everything alive, and space out the young collections (call once, when
    the process is ready to serve)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
