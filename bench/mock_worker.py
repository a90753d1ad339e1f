"""A mock worker for the gateway benches: one token per request, over gRPC and over HTTP.

    python -m bench.mock_worker --role decode --grpc-port P --http-port H [--tokens N]

The same process answers our gateway (the Worker gRPC service with the Session stream,
tests/gateway/gw_doubles.py's ScriptedWorker) and the Rust routers (SGLang-style HTTP:
/v1/completions, /generate, /health, /get_model_info, /get_server_info, /v1/models), so every
router is measured against the same worker doing the same (no) work. The HTTP side is a bare
asyncio protocol on httptools, a few microseconds a request, so the mock is not what limits a
router. `--tokens N --step-ms S` streams N tokens, one a step of S ms shared by every request (the
per-token bench): on gRPC, and on HTTP as N server-sent events of one chunk each for a decode
or mono mock (a prefill mock answers one event at once, as a prefill server's stream does).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httptools

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol import tandem_pb2  # noqa: E402
from tests.gateway.gw_doubles import Script, ScriptedWorker  # noqa: E402

TOKEN = 70  # detokenizes to one character with the bench tokenizer
_BODY = (b'{"id":"cmpl-mock","object":"text_completion","created":0,"model":"tiny","choices":'
         b'[{"index":0,"text":"F","logprobs":null,"finish_reason":"length"}],"usage":'
         b'{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')
_EVENT = (b'data: {"id":"cmpl-mock","object":"text_completion","created":0,"model":"tiny",'
          b'"choices":[{"index":0,"text":"F","logprobs":null,"finish_reason":%s}]}\n\n')
_SSE = _EVENT % b'"length"' + b"data: [DONE]\n\n"
_CHUNKED_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
_GET = {
    b"/get_model_info": b'{"model_path":"tiny","tokenizer_path":"tiny","is_generation":true}',
    b"/get_server_info": b'{"model_path":"tiny","disaggregation_mode":"null"}',
    b"/v1/models": b'{"object":"list","data":[{"id":"tiny","object":"model","created":0,'
                   b'"owned_by":"mock"}]}',
}


def _response(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class HTTPSteps:
    """The HTTP side's step clock: each tick writes every open stream's next event (one chunk);
    a stream's last event carries finish_reason "length", then `[DONE]` and the last chunk."""

    def __init__(self, tokens: int, step_s: float) -> None:
        self.tokens = tokens
        self.step_s = step_s
        self._streams: dict[asyncio.Transport, int] = {}  # transport -> events still to send
        self._ticking = False

    def start(self, transport: asyncio.Transport) -> None:
        transport.write(_CHUNKED_HEAD + _chunk(_EVENT % b"null"))
        self._streams[transport] = self.tokens - 1
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_later(self.step_s, self._tick)

    def _tick(self) -> None:
        for transport, left in list(self._streams.items()):
            if transport.is_closing():
                del self._streams[transport]
            elif left > 1:
                transport.write(_chunk(_EVENT % b"null"))
                self._streams[transport] = left - 1
            else:
                transport.write(_chunk(_EVENT % b'"length"' + b"data: [DONE]\n\n") + b"0\r\n\r\n")
                del self._streams[transport]
        self._ticking = bool(self._streams)
        if self._ticking:
            asyncio.get_running_loop().call_later(self.step_s, self._tick)


class MockHTTP(asyncio.Protocol):
    """Keep-alive HTTP/1.1: every POST answers one token (JSON, or SSE when asked), or streams
    `steps.tokens` events on the step clock when one is given."""

    def __init__(self, steps: HTTPSteps | None = None) -> None:
        self._steps = steps
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._transport is not None
        body = b"".join(self._body)
        self._body = []
        path = self._url.split(b"?")[0]
        if self._parser.get_method() == b"POST":
            stream = b'"stream":true' in body.replace(b" ", b"")
            if stream and self._steps is not None:
                self._steps.start(self._transport)
                return
            resp = _response(_SSE, b"text/event-stream") if stream else _response(_BODY)
        else:
            resp = _response(_GET.get(path, b"{}"))
        self._transport.write(resp)


class SteppedWorker(ScriptedWorker):
    """Tokens on one step clock, as an engine makes them: every running request's next token
    at the same tick, so the Session stream carries one message a step (a request's own
    timer would spread a step's tokens over several messages)."""

    def __init__(self, step_s: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.step_s = step_s
        self._tick: asyncio.Future[None] | None = None  # the next step's end

    async def respond(self, request: tandem_pb2.GenerateRequest  # type: ignore[override]
                      ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        async for msg in self._script(request):
            yield msg
            if msg.finish_reason:
                return
            await self._next_step()

    async def _next_step(self) -> None:
        """Wait for the step in progress to end (the first waiter starts one)."""
        if self._tick is None or self._tick.done():
            loop = asyncio.get_running_loop()
            self._tick = loop.create_future()
            loop.call_later(self.step_s, self._tick.set_result, None)
        await asyncio.shield(self._tick)  # a cancelled request must not end the step for all


async def serve(role: str, grpc_port: int, http_port: int, tokens: int, step_ms: float) -> None:
    script = Script(tokens=[TOKEN] * tokens, finish_reason="length")
    w = (SteppedWorker(step_ms / 1e3, role=role, max_model_len=4096, script=script) if step_ms
         else ScriptedWorker(role=role, max_model_len=4096, script=script))
    await w.start(port=grpc_port)
    if http_port:
        loop = asyncio.get_running_loop()
        steps = HTTPSteps(tokens, step_ms / 1e3) if step_ms and role != "prefill" else None
        await loop.create_server(lambda: MockHTTP(steps), "127.0.0.1", http_port,
                                 reuse_address=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.role, args.grpc_port, args.http_port, args.tokens, args.step_ms))


if __name__ == "__main__":
    main()
