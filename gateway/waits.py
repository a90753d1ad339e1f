"""A bounded wait for an asyncio.Event that a cancellation always ends.

Python 3.11's `asyncio.wait_for` returns the awaited result when the event fires in the turn
its task is cancelled, and the cancel is lost: a health watch looped on after the pool's close
had cancelled it, and the gateway's shutdown waited for it forever (the close came as a
worker's connection dropped and asked for a recheck). `asyncio.wait` never swallows the
cancel; the waiter task is cancelled on every way out.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True once `event` is set, False after `timeout_s` without it; a cancellation of the
    caller raises CancelledError, whatever the event does in the same turn."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait((waiter,), timeout=timeout_s)
    finally:
        waiter.cancel()
    return bool(done)
