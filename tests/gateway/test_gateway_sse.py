"""SSEResponse and DisconnectWatcher as plain ASGI: disconnects end the body generator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.sse import DisconnectWatcher, SSEResponse

pytestmark = pytest.mark.anyio


class Body:
    """A body generator that records whether its `finally` ran."""

    def __init__(self, n: int, hang: bool = False) -> None:
        self.n, self.hang, self.closed = n, hang, False

    async def gen(self) -> AsyncIterator[bytes]:
        try:
            for i in range(self.n):
                yield b"data: %d\n\n" % i
            if self.hang:
                await asyncio.sleep(3600)
        finally:
            self.closed = True


async def test_streams_all_chunks():
    body, sent = Body(3), []

    async def send(msg):
        sent.append(msg)

    async def receive():
        await asyncio.sleep(3600)

    await SSEResponse(body.gen(), {"x-request-id": "r"})(
        {"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send
    )
    assert sent[0]["status"] == 200 and (b"x-request-id", b"r") in sent[0]["headers"]
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert sent[-1]["more_body"] is False and body.closed


async def test_disconnect_cancels_a_waiting_body():
    body, gone = Body(1, hang=True), asyncio.Event()

    async def send(msg):
        if msg.get("body"):
            gone.set()  # the client leaves once it has the first event

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(SSEResponse(body.gen(), {})({"type": "http"}, receive, send))
    await asyncio.wait_for(task, 5)
    assert body.closed and not task.cancelled()  # the generator's finally ran; no stray cancel


async def test_abandoned_before_start_calls_owner():
    body, abandoned = Body(1), []

    async def send(msg):
        raise OSError("client gone")  # ASGI 2.4 servers raise on a send to a gone client

    async def receive():
        await asyncio.sleep(3600)

    resp = SSEResponse(body.gen(), {}, on_abandon=lambda: abandoned.append(True))
    await resp({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert abandoned == [True] and not body.closed


async def test_watcher_cancels_only_on_disconnect():
    got = asyncio.Event()

    async def receive():
        await got.wait()
        return {"type": "http.disconnect"}

    async def work(w_out: list[DisconnectWatcher]) -> str:
        w = DisconnectWatcher(receive)
        w_out.append(w)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            assert w.fired
            w.absorb()
            return "left"
        finally:
            w.stop()
        return "done"

    ws: list[DisconnectWatcher] = []
    task = asyncio.ensure_future(work(ws))
    await asyncio.sleep(0.01)
    assert not task.done()
    got.set()
    assert await asyncio.wait_for(task, 5) == "left"
