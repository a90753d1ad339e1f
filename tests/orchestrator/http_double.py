"""A stdlib HTTP server on a free loopback port, in a thread, for the client doubles
(openai_double.py, chat_double.py): each gives its request handler (a JsonHandler) and its
state."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class DoubleServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], state: Any) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.state = state  # the handler reads it as self.server.state


class JsonHandler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1, quiet, answering JSON; reads its state as self.server.state."""

    server: DoubleServer  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (quiet test output)
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class HttpDouble:
    """Context manager: `with Double(state) as url:` serves until the block ends."""

    handler: type[BaseHTTPRequestHandler]

    def __init__(self, state: Any) -> None:
        self.state = state
        self._server = DoubleServer(self.handler, state)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        port = self._server.server_address[1]  # bound to 127.0.0.1 (DoubleServer)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
