"""One load point from several load-generator processes (`tandem bench --clients N`).

Why: one Python asyncio client parses every SSE event of every stream on one core. At high
concurrency on a fast engine that core, not the server, sets the rate: the client falls
behind, reads several of a stream's events back to back (an ITL p50 of tens of µs says so), and
a closed loop's next request leaves late. N processes each run `run_bench` over every N-th
session (process k takes sessions k, k+N, ...; a closed loop's concurrency is split as evenly),
so the client side has N cores. There is no progress bar across the processes. This module
knows nothing of what a share runs: orchestrator/bench.py passes `_run_share`.

Lifecycle: spawn the N processes; each opens its client and asks the server its model, then
reports ready and waits; once all are ready the parent starts them together, each runs its
share and sends back its results and its own duration. The point's duration is the longest
share's. Failure paths: a process that raises sends the error, which the parent re-raises after
stopping the others (a `ServerError` stays one, so an unreachable server still exits 2; any
other arrives as a LoadError naming the process and the exception, pickled or not);
a process that dies without a word (killed, out of memory) is a LoadError naming it. `tandem
bench` prints either as one line.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import signal
from collections.abc import Callable
from typing import Any

from orchestrator.bench_stats import RequestResult
from orchestrator.client import ServerError

_POLL_S = 1.0
# What a process runs: share(*args, k, n, ready) -> (results, duration); a module-level function
# (spawn pickles it by name), which calls ready() once set up, before its clock starts.
Share = Callable[..., tuple[list[RequestResult], float]]


class LoadError(RuntimeError):
    """A load-generator process failed (raised, or died without a word); names which."""


def shares(width: int, n: int) -> list[int]:
    """A closed loop's `width` requests in flight split over n processes, as evenly as can be."""
    return [width // n + (1 if k < width % n else 0) for k in range(n)]


def _child(share: Share, args: tuple[Any, ...], k: int, n: int, out: Any, go: Any) -> None:
    """Process k of n: run its share of the load point and send back what it got."""

    def ready() -> None:
        out.put(("ready", k))
        go.wait()

    try:
        results, duration = share(*args, k, n, ready)
    except ServerError as exc:  # unreachable server: the parent re-raises it (exit status 2)
        out.put(("error", k, exc))
        return
    except BaseException as exc:  # as text: an exception that does not pickle would be lost
        out.put(("error", k, LoadError(
            f"load generator process {k} of {n}: {type(exc).__name__}: {exc}")))
        return
    out.put(("done", k, results, duration))


def run_processes(share: Share, args: tuple[Any, ...], n: int
                  ) -> tuple[list[RequestResult], float]:
    """(results, duration) of one load point run by n processes started together."""
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_child, args=(share, args, k, n, out, go), daemon=True)
             for k in range(n)]
    # Started with SIGINT ignored (inherited through spawn's exec: Python then installs no
    # KeyboardInterrupt): a terminal's Ctrl-C reaches the whole group, and the parent, which
    # alone reports what was done, stops its processes itself (the `finally` below).
    sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, sigint)
    ready: set[int] = set()
    done: dict[int, tuple[list[RequestResult], float]] = {}
    try:
        while len(done) < n:
            try:
                msg = out.get(timeout=_POLL_S)
            except queue_mod.Empty:
                for k, p in enumerate(procs):
                    if k not in done and p.exitcode is not None:
                        raise LoadError(
                            f"load generator process {k} of {n} exited with status "
                            f"{p.exitcode} before sending its results") from None
                continue
            if msg[0] == "error":
                raise msg[2]
            if msg[0] == "ready":
                ready.add(msg[1])
                if len(ready) == n:
                    go.set()
            else:
                done[msg[1]] = (msg[2], msg[3])
    finally:
        for p in procs:
            if p.is_alive() and len(done) < n:
                p.terminate()
            p.join(timeout=10)
    results = [r for k in range(n) for r in done[k][0]]
    return results, max(d for _, d in done.values())
