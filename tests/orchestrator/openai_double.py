"""A test double of an OpenAI-compatible server for `tandem eval` and `tandem bench` tests.

It is not a model: it knows the right answer of each prompt (a dict given by the test) and
answers right, wrong, or with an HTTP error according to a per-request rule. Streaming
requests get `max_tokens` one-character SSE chunks (honouring `ignore_eos`), then a usage
chunk and `[DONE]`. Runs a stdlib ThreadingHTTPServer on a free loopback port in a thread.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.orchestrator.http_double import HttpDouble, JsonHandler

# rule(index of the request, prompt) -> "right" | "wrong" | "fail"
Rule = Callable[[int, Any], str]


@dataclass
class DoubleState:
    answers: dict[str, str] = field(default_factory=dict)  # prompt -> completion text
    rule: Rule = lambda i, prompt: "right"
    model: str = "double-model"
    api_key: str = ""
    token_delay_s: float = 0.0  # between streamed chunks
    # A scripted stream instead: per network write, (seconds to wait before it, the token
    # count of each SSE event in it). Events of one write leave in one send (one TCP burst).
    writes: list[tuple[float, list[int]]] | None = None
    write_times: list[float] = field(default_factory=list)  # perf_counter() of each scripted write
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received
    inflight: int = 0
    max_inflight: int = 0  # most POSTs being answered at once (checks client concurrency)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(JsonHandler):

    def setup(self) -> None:
        super().setup()
        # As uvicorn does: each write leaves at once (Nagle would hold small SSE writes until
        # the client's delayed ACK, ~40 ms, and merge them: not the stream a test scripts).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _authorized(self) -> bool:
        key = self.server.state.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._json(
                401,
                {"error": {"message": "bad api key", "type": "invalid_request_error", "code": 401}},
            )
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(
                200,
                {"object": "list", "data": [{"id": self.server.state.model, "object": "model"}]},
            )
        elif self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(
                404, {"error": {"message": "no such path", "type": "not_found", "code": 404}}
            )

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        st = self.server.state
        with st.lock:
            index = len(st.requests)
            st.requests.append(body)
            st.inflight += 1
            st.max_inflight = max(st.max_inflight, st.inflight)
        try:
            self._answer(body, index)
        finally:
            with st.lock:
                st.inflight -= 1

    def _answer(self, body: dict[str, Any], index: int) -> None:
        st = self.server.state
        verdict = st.rule(index, body["prompt"])
        if verdict == "fail":
            self._json(
                503,
                {
                    "error": {
                        "message": "no healthy worker",
                        "type": "service_unavailable",
                        "code": 503,
                    }
                },
            )
            return
        key = body["prompt"] if isinstance(body["prompt"], str) else json.dumps(body["prompt"])
        text = st.answers.get(key, "x" * int(body.get("max_tokens", 1)))
        if verdict == "wrong":
            text = "wrong" + text
        if body.get("stream"):
            self._stream(body)
        else:
            time.sleep(st.token_delay_s)  # the double's "generation time"
            self._json(200, {"id": f"cmpl-{index}", "object": "text_completion", "model": st.model,
                             "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})

    def _stream(self, body: dict[str, Any]) -> None:
        n = int(body["max_tokens"]) if body.get("ignore_eos") else 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(payload: str) -> None:
            data = f"data: {payload}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        prompt_len = len(body["prompt"])
        if self.server.state.writes is not None:
            self._scripted(body, prompt_len)
            return
        for _ in range(n):
            time.sleep(self.server.state.token_delay_s)  # the double's "decode step"
            send(
                json.dumps(
                    {
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "a", "finish_reason": None}],
                    }
                )
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            send(
                json.dumps(
                    {
                        "object": "text_completion",
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_len,
                            "completion_tokens": n,
                            "total_tokens": prompt_len + n,
                        },
                    }
                )
            )
        send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


    def _scripted(self, body: dict[str, Any], prompt_len: int) -> None:
        writes = self.server.state.writes or []
        total = 0
        for delay, events in writes:
            time.sleep(delay)
            data = b""
            for k in events:
                choice: dict[str, Any] = {"index": 0, "text": "a" * k, "finish_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = list(range(total, total + k))
                total += k
                data += f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            self.server.state.write_times.append(time.perf_counter())
        usage = {"prompt_tokens": prompt_len, "completion_tokens": total,
                 "total_tokens": prompt_len + total}
        data = f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data.encode() + b"\r\n0\r\n\r\n")
        self.wfile.flush()


class OpenAIDouble(HttpDouble):
    """Context manager: `with OpenAIDouble(state) as url:` serves until the block ends."""

    handler = _Handler
