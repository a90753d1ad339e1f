"""Connection hygiene: no socket holds the gateway open without sending a request.

uvicorn (0.54) closes a kept-alive connection that stays idle after a response
(`timeout_keep_alive`), but nothing else: a socket that connects and sends nothing, or sends
half a header (slow-loris), stays open for ever, and `limit_concurrency` only answers 503 to
requests once that many sockets exist, so idle sockets would lock every client out. The
protocol built here is the gateway's httptools protocol (gateway/http_protocol.py: TCP_NODELAY,
gathered writes) plus:

- a header deadline (`gateway.header_timeout_s`): a request's headers must be complete within
  it, counted from the connection (first request) or from the request's first byte (later
  requests on a kept-alive connection). Past it the gateway answers 408 and closes (a socket
  that sent no byte at all is just closed);
- a connection bound (`gateway.max_connections`): a connection beyond it is answered 503 and
  closed at once, so the gateway's file descriptors stay bounded while the deadlines reap;
- a header size bound (`gateway.max_header_bytes`): httptools buffers a header line without
  limit until it ends, so a request whose headers pass it is answered 431 and closed (memory
  stays bounded by max_connections x the bound, not by what clients send in the deadline);
- a request httptools cannot parse gets an OpenAI-shaped 400 (uvicorn's is text/plain).

The body has its own deadline in the app (`gateway.body_timeout_s`, gateway/serving.py) and an
idle kept-alive connection closes after `gateway.keepalive_timeout_s` (uvicorn's timer). The
hot path pays one timer per request (armed at its first byte, cancelled at its last header).
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.http_protocol import NoDelayHttpToolsProtocol

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_400 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s")


def _body(message: str, code: str) -> bytes:
    return (b'{"error": {"message": "%s", "type": "invalid_request_error", "code": "%s", '
            b'"param": null}}' % (message.encode(), code.encode()))


def guarded_protocol(header_timeout_s: float, max_connections: int,
                     max_header_bytes: int = 64 * 1024) -> type[asyncio.Protocol]:
    """The gateway's httptools protocol with a header deadline, a connection bound and a header
    size bound (a class per gateway, so the settings travel with it and nothing is kept at
    module level)."""
    timeout_body = _body(f"request headers incomplete after {header_timeout_s:g} s "
                         "(gateway.header_timeout_s)", "header_timeout")
    full_body = _body(f"the gateway holds {max_connections} connections "
                      "(gateway.max_connections); retry shortly", "too_many_connections")
    large_body = _body(f"request headers exceed {max_header_bytes} bytes "
                       "(gateway.max_header_bytes)", "headers_too_large")
    bad_body = _body("the request is not valid HTTP/1.1", "invalid_http")

    class GuardedHttpToolsProtocol(NoDelayHttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _request_started = False  # a byte of the current request arrived
        _header_bytes = 0  # bytes of the current request's unfinished headers seen so far
        _requests = 0  # requests begun on this connection (tells a chunk's requests apart)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.transport.write(_503 % (len(full_body), full_body))
                self.transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            in_headers, begun = self._header_timer is not None, self._requests
            if in_headers:
                self._request_started = True
            super().data_received(data)
            # Only a chunk that began and ended inside one request's headers is all header
            # bytes (one that ends them holds body bytes): the bound is exact to two chunks.
            if in_headers and self._header_timer is not None and begun == self._requests:
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                    self._disarm()
                    self.transport.write(_431 % (len(large_body), large_body))
                    self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_400 % (len(bad_body), bad_body))
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._requests += 1
            self._request_started = True
            if self._header_timer is None:  # a later request on a kept-alive connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._request_started = False
            self._header_bytes = 0

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._request_started:  # half a request: say why before closing
                self.transport.write(_408 % (len(timeout_body), timeout_body))
            self.transport.close()

    return GuardedHttpToolsProtocol
