"""gateway/waits.py: a bounded Event wait that never swallows its caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from gateway.waits import wait_event

pytestmark = pytest.mark.anyio


async def test_set_times_out_and_a_cancel_that_meets_the_event_is_kept():
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    ev.set()
    assert await wait_event(ev, 0.01) is True

    async def watch() -> None:  # the health watch's shape: clear, then wait for a recheck
        while True:
            ev.clear()
            await wait_event(ev, 30.0)

    task = asyncio.ensure_future(watch())
    await asyncio.sleep(0.01)
    ev.set()  # the event fires in the turn the task is cancelled
    task.cancel()
    done, _ = await asyncio.wait((task,), timeout=2.0)
    assert done and task.cancelled()  # asyncio.wait_for on 3.11: the watch looped on
