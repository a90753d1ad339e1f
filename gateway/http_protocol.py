"""uvicorn's httptools protocol, tuned for small answers: TCP_NODELAY, one write per turn.

uvicorn writes a response's head and its body as two socket writes. With Nagle's algorithm on,
the body of a small non-streamed answer waits for the client's delayed ACK of the head (~3 ms
on loopback for an answer ready in 0.2 ms), so client connections get TCP_NODELAY. Without
Nagle every write is a packet and a syscall, so the cycle's writes are gathered for the rest of
the event loop's turn and leave as one (`_GatheredWrites`): a non-streamed answer is one write.
A stream's events skip uvicorn's per-message `send` (`DirectChunks`), a body that arrived
whole is read without a deadline (`body_arrived`), and the connection tells the requests that
watch it when its socket is gone (`connection_of`: no task per request waits for that).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _GatheredWrites:
    """The connection's transport as uvicorn's request cycle sees it: writes wait for the end
    of the loop's turn and go out joined; callbacks given to `watch_lost` run once the socket
    is gone; everything else is the real transport's."""

    __slots__ = ("_transport", "_loop", "_parts", "_scheduled", "_on_lost")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []
        self._scheduled = False
        self._on_lost: list[Callable[[], None]] = []  # called once the client's socket is gone

    def watch_lost(self, callback: Callable[[], None]) -> None:
        self._on_lost.append(callback)

    def unwatch_lost(self, callback: Callable[[], None]) -> None:
        if callback in self._on_lost:  # not once the connection was lost: the list is spent
            self._on_lost.remove(callback)

    def lost(self) -> None:
        callbacks, self._on_lost = self._on_lost, []
        for callback in callbacks:
            callback()

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._parts.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()  # what the cycle wrote before closing still goes out
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class NoDelayHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        # The request cycles write through this; flow control keeps the real transport.
        self.transport = _GatheredWrites(transport, asyncio.get_running_loop())  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        out = self.transport
        super().connection_lost(exc)
        if isinstance(out, _GatheredWrites):
            out.lost()


def _cycle(bound: Any) -> Any:
    """The uvicorn request cycle behind an ASGI `receive` or `send` (a bound method of it);
    None for another server's (whose attributes the callers below then do not find)."""
    return getattr(bound, "__self__", None)


def connection_of(receive: Any) -> _GatheredWrites | None:
    """The connection of a uvicorn request cycle's `receive`, when it is this gateway's own
    protocol's: it tells its watchers when the client's socket is gone (`watch_lost`)."""
    out = getattr(_cycle(receive), "transport", None)
    return out if isinstance(out, _GatheredWrites) else None


def client_gone(receive: Any) -> bool:
    """The cycle already knows its client left (the next `receive()` says http.disconnect)."""
    return getattr(_cycle(receive), "disconnected", False) is True


def body_arrived(receive: Any) -> bool:
    """True when `receive` is a uvicorn request cycle's and the cycle holds the request's
    whole body: the next `receive()` returns it without waiting (uvicorn sets its message
    event when the body's last byte arrived and clears it once read)."""
    cycle = _cycle(receive)
    event = getattr(cycle, "message_event", None)
    return (isinstance(event, asyncio.Event) and event.is_set()
            and getattr(cycle, "more_body", True) is False
            and getattr(cycle, "disconnected", True) is False)


class DirectChunks:
    """A started chunked response's body events, written straight to its connection.

    uvicorn's ASGI `send` costs ~3.4 µs an event on the dev box (an awaited call, its state
    checks, the chunk framed as a list and joined) against ~0.2 µs for framing the chunk
    here; the event still leaves with the turn's gathered write (writing each one at once
    measured slower: the client's wake-ups then interleave with the turn's work). `of(send)`
    gives one only for this gateway's own protocol (the cycle writes through
    `_GatheredWrites`) and a chunked response (HTTP/1.1); `write` refuses while the client is
    gone or the transport is paused for flow control, and the caller then sends through ASGI
    as before (which waits for the drain). The response's start and end always go through
    ASGI, so uvicorn's cycle state stays its own.
    """

    __slots__ = ("_cycle", "_out")

    def __init__(self, cycle: Any, out: _GatheredWrites) -> None:
        self._cycle = cycle
        self._out = out

    @classmethod
    def of(cls, send: Any) -> DirectChunks | None:
        """After `http.response.start` was sent through `send` (the encoding is chosen then)."""
        cycle = _cycle(send)
        out = getattr(cycle, "transport", None)
        chunked = getattr(cycle, "chunked_encoding", None) is True
        if not (isinstance(out, _GatheredWrites) and chunked and hasattr(cycle, "flow")):
            return None
        return cls(cycle, out)

    def writable(self) -> bool:
        """False while the client is gone or its transport is paused for flow control."""
        cycle = self._cycle
        return not (cycle.disconnected or cycle.flow.write_paused)

    def write(self, chunk: bytes) -> bool:
        """The event as one HTTP/1.1 chunk; False when it must go through ASGI `send`."""
        if not chunk or not self.writable():
            return False
        self.put(chunk)
        return True

    def put(self, chunk: bytes) -> None:
        """`write` for a caller that found the connection `writable()` in this turn, with a
        chunk that is not empty."""
        self._out.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
