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


async def _watched_wait(receive) -> str:
    """A request's wait under a DisconnectWatcher: "left" when the watcher ended it."""
    w = DisconnectWatcher(receive)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        assert w.fired
        w.absorb()
        return "left"
    finally:
        w.stop()
    return "done"


async def test_watcher_cancels_only_on_disconnect():
    got = asyncio.Event()

    async def receive():
        await got.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(_watched_wait(receive))
    await asyncio.sleep(0.01)
    assert not task.done()
    got.set()
    assert await asyncio.wait_for(task, 5) == "left"


async def test_watcher_on_our_protocol_fires_on_a_lost_socket_and_on_one_lost_already():
    """On the gateway's own connection no task waits on receive(): the connection calls the
    watcher back when its socket goes; a client gone before the watcher began counts too."""
    from gateway.http_protocol import _GatheredWrites

    class Transport:
        def is_closing(self) -> bool:
            return False

    class Cycle:  # what a uvicorn cycle's receive is bound to, as far as the watcher looks
        def __init__(self, disconnected: bool) -> None:
            self.transport = _GatheredWrites(Transport(), asyncio.get_running_loop())
            self.disconnected = disconnected

        async def receive(self) -> dict:
            raise AssertionError("no task may wait on receive() here")

    live = Cycle(disconnected=False)
    task = asyncio.ensure_future(_watched_wait(live.receive))
    await asyncio.sleep(0.01)
    assert not task.done()
    live.transport.lost()  # what the protocol's connection_lost calls
    assert await asyncio.wait_for(task, 5) == "left"
    assert await asyncio.wait_for(_watched_wait(Cycle(disconnected=True).receive), 5) == "left"


def test_direct_chunks_frame_events_and_defer_to_asgi_when_they_must():
    """DirectChunks writes an event as one HTTP/1.1 chunk, and refuses (the caller then uses
    ASGI `send`, which waits out flow control) while paused, after a disconnect, for an empty
    event; it exists only for this gateway's protocol and a chunked response."""
    from types import SimpleNamespace

    from gateway.http_protocol import DirectChunks, _GatheredWrites

    wire: list[bytes] = []
    raw = SimpleNamespace(write=wire.append, is_closing=lambda: False)
    loop = asyncio.new_event_loop()  # holds the deferred flushes; the test flushes by hand
    out = _GatheredWrites(raw, loop)  # type: ignore[arg-type]
    cycle = SimpleNamespace(transport=out, chunked_encoding=True, disconnected=False,
                            flow=SimpleNamespace(write_paused=False))

    class Cycle:  # what uvicorn's send is bound to
        def __init__(self, **kw: object) -> None:
            self.__dict__.update(kw)

        async def send(self, message: object) -> None: ...

    direct = DirectChunks.of(Cycle(**vars(cycle)).send)
    assert direct is not None
    assert direct.write(b"data: 1\n\n") and wire == []
    out.flush()  # the end of the loop's turn
    assert wire == [b"9\r\ndata: 1\n\n\r\n"]
    out.write(b"head")  # gathered this turn: the event goes out after it, in one write
    assert direct.write(b"data: 22\n\n")
    out.flush()
    assert wire[1] == b"head" + b"a\r\ndata: 22\n\n\r\n"
    assert not direct.write(b"")
    direct._cycle.flow.write_paused = True
    assert not direct.write(b"data: 3\n\n")
    direct._cycle.flow.write_paused, direct._cycle.disconnected = False, True
    assert not direct.write(b"data: 3\n\n")
    out.flush()
    assert len(wire) == 2
    assert DirectChunks.of(Cycle(**{**vars(cycle), "chunked_encoding": False}).send) is None
    assert DirectChunks.of(Cycle(**{**vars(cycle), "transport": raw}).send) is None
    assert DirectChunks.of(lambda message: None) is None
    loop.close()
