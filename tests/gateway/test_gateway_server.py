"""The gateway as a real process: uvicorn (run_gateway), the openai client, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, workers

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def gateway_process(tok_dir: Path, worker_url: str, log: Path | None = None,
                          config: str = "") -> AsyncIterator[str]:
    """A gateway process on a free port; its stdout and stderr go to `log` when given;
    `config`: more GatewayConfig keywords, as source text ("stream_stall_timeout_s=0.3, ")."""
    port = free_port()
    code = (
        "from gateway.config import GatewayConfig; from gateway.server import run_gateway; "
        f"run_gateway(GatewayConfig(port={port}, workers=({worker_url!r},), "
        f"model_path={str(tok_dir)!r}, health_interval_s=0.05, load_interval_s=0.05, "
        f"{config}log_level='warning'))"
    )
    out = log.open("wb") if log is not None else None
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT if out is not None else None)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(300):  # readiness: /health says 200 (bounded: 15 s)
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                assert proc.poll() is None, "gateway process exited during start-up"
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("gateway did not become healthy within 15 s")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            if out is not None:
                out.close()
    assert rc == 0  # SIGTERM is a clean shutdown


async def test_openai_client_against_real_server(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    w = ScriptedWorker(
        script=Script(
            tokens=tok.encode("héllo 🙂 wörld", add_special_tokens=False),
            finish_reason="stop",
            delay_s=0.02,
        )
    )
    async with workers(w), gateway_process(tok_dir, w.url) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        comp = await client.completions.create(model="tiny", prompt="hello", max_tokens=30)
        assert comp.choices[0].text == "héllo 🙂 wörld" and comp.choices[0].finish_reason == "stop"
        assert comp.usage is not None and comp.usage.completion_tokens == len(w.script.tokens)
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
        assert chat.choices[0].message.content == "héllo 🙂 wörld"
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(parts) == "héllo 🙂 wörld"
        assert usage is not None and usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.BadRequestError, match="n must be <= 128"):
            await client.completions.create(model="tiny", prompt="x", n=129)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x")
        await client.close()


async def test_client_disconnect_aborts_worker(tok_dir):
    w = ScriptedWorker(
        max_model_len=1024, script=Script(tokens=[70 + i % 50 for i in range(500)], delay_s=0.02)
    )
    async with workers(w), gateway_process(tok_dir, w.url) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(
            model="tiny", prompt="x", max_tokens=500, stream=True
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        await asyncio.wait_for(w.abort_event.wait(), 5)
        assert w.aborts[0].request_id == w.requests[0].request_id
        await client.close()


def test_gateway_never_imports_torch(tok_dir):
    code = (
        "import sys; from gateway.config import GatewayConfig; from gateway.app import create_app; "
        "import gateway.server; "
        f"create_app(GatewayConfig(workers=('127.0.0.1:1',), model_path={str(tok_dir)!r})); "
        "bad = [m for m in ('torch', 'transformers', 'worker', 'transfer') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


async def test_client_timeout_before_first_token_aborts_worker(tok_dir):
    # A non-streaming client that gives up while the worker has not answered yet.
    w = ScriptedWorker(script=Script(tokens=[70, 71], first_delay_s=30))
    async with workers(w), gateway_process(tok_dir, w.url) as url:
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post(
                    f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=0.5
                )
        await asyncio.wait_for(w.abort_event.wait(), 5)
        assert w.aborts[0].request_id == w.requests[0].request_id
        async with httpx.AsyncClient() as client:
            m = (await client.get(f"{url}/metrics")).text
        assert 'tandem_requests_total{outcome="aborted"} 1.0' in m


def _read_response(sock: socket.socket, buf: bytes) -> tuple[bytes, bytes, bytes]:
    """One HTTP response from `sock` (after what `buf` already holds): (head, body, the bytes
    after it). Chunked bodies are de-chunked by hand, so a malformed frame fails here."""
    def fill(n: int) -> None:
        nonlocal buf
        while len(buf) < n:
            more = sock.recv(65536)
            assert more, f"connection closed mid-response: {buf[-200:]!r}"
            buf += more

    while b"\r\n\r\n" not in buf:
        fill(len(buf) + 1)
    head, buf = buf.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" not in head.lower():  # HTTP/1.0: the body ends at close
        while more := sock.recv(65536):
            buf += more
        return head, buf, b""
    body = b""
    while True:
        while b"\r\n" not in buf:
            fill(len(buf) + 1)
        size_line, buf = buf.split(b"\r\n", 1)
        size = int(size_line, 16)
        fill(size + 2)
        assert buf[size:size + 2] == b"\r\n", buf[:size + 2]
        body, buf = body + buf[:size], buf[size + 2:]
        if size == 0:
            return head, body, buf


async def test_streamed_events_are_exact_chunks_and_the_connection_lives_on(tok_dir):
    """Stream events leave as HTTP/1.1 chunks written past uvicorn's send (DirectChunks): the
    framing is exact, a slow reader (flow control) loses nothing, the kept-alive connection
    serves the next request, and an HTTP/1.0 client (no chunked encoding) gets the same
    events through uvicorn's own path."""
    tok = Tokenizer.from_dir(tok_dir)
    tokens = tok.encode(" word" * 500, add_special_tokens=False)  # ~300 KB of events
    w = ScriptedWorker(script=Script(tokens=tokens, finish_reason="length"),
                       max_model_len=len(tokens) + 8)
    async with workers(w), gateway_process(tok_dir, w.url) as url:
        host, port = url.removeprefix("http://").split(":")
        body = b'{"prompt": "x", "max_tokens": %d, "stream": true}' % len(tokens)

        def request(version: bytes) -> bytes:
            return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body))

        def texts(raw: bytes) -> str:
            events = [e[6:] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]
                           if json.loads(e)["choices"])

        def exchange() -> tuple[list[str], str]:
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(request(b"1.1"))
                time.sleep(1.0)  # nothing read yet: the gateway's transport fills and pauses
                head, first, rest = _read_response(s, b"")
                s.sendall(request(b"1.1"))  # the same connection: the cycle ended cleanly
                _, second, _ = _read_response(s, rest)
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(request(b"1.0"))
                head10, old, _ = _read_response(s, b"")
            assert b" 200 " in head.split(b"\r\n")[0] and b" 200 " in head10.split(b"\r\n")[0]
            return [texts(first), texts(second)], texts(old)

        streamed, http10 = await asyncio.to_thread(exchange)
    want = tok.decode(tokens)
    assert streamed == [want, want] and http10 == want


async def test_pushed_events_equal_the_tasks_events(tok_dir):
    """Over HTTP/1.1 a stream's outputs are pushed from the worker's stream (gateway/
    streaming.py); over HTTP/1.0 (no chunked encoding, no direct writes) the request's task
    writes each. The events are the same bytes but for ids: a stop string met mid-stream
    (the push path's ENDED, then an abort to the worker), chat deltas, usage, logprobs in
    both shapes, token ids, [DONE]."""
    tok = Tokenizer.from_dir(tok_dir)
    # A long tail after the stop string: the abort reaches the worker well before its end.
    tokens = tok.encode(" alpha beta gamma delta" + " epsilon zeta" * 4,
                        add_special_tokens=False)
    w = ScriptedWorker(script=Script(tokens=tokens, finish_reason="length", delay_s=0.01),
                       max_model_len=len(tokens) + 64)
    bodies = [
        {"prompt": "x", "max_tokens": len(tokens), "stream": True, "stop": ["delta"],
         "stream_options": {"include_usage": True}},
        {"prompt": "x", "max_tokens": len(tokens), "stream": True},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": len(tokens),
         "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "max_tokens": 12, "stream": True, "logprobs": 2,
         "return_token_ids": True},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "stream": True,
         "logprobs": True, "top_logprobs": 2},
    ]

    def events(version: bytes, body: dict) -> list[dict | str]:
        raw = json.dumps(body).encode()
        path = b"/v1/chat/completions" if "messages" in body else b"/v1/completions"
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST " + path + b" HTTP/" + version + b"\r\nhost: x\r\n"
                      b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                      % (len(raw), raw))
            _, payload, _ = _read_response(s, b"")
        out: list[dict | str] = []
        for e in payload.decode().split("\n\n"):
            if e.startswith("data: {"):
                out.append({k: v for k, v in json.loads(e[6:]).items()
                            if k not in ("id", "created")})
            elif e:
                out.append(e)
        return out

    async with workers(w), gateway_process(tok_dir, w.url) as url:
        host, port = url.removeprefix("http://").split(":")
        for body in bodies:
            pushed = await asyncio.to_thread(events, b"1.1", body)
            by_task = await asyncio.to_thread(events, b"1.0", body)
            assert pushed == by_task and pushed[-1] == "data: [DONE]", (pushed, by_task)
            assert len(pushed) >= 6  # one event a token: the outputs came one by one
        stopped = await asyncio.to_thread(events, b"1.1", bodies[0])
    text = "".join(e["choices"][0]["text"] for e in stopped[:-1]  # type: ignore[index]
                   if isinstance(e, dict) and e["choices"])
    assert text == tok.decode(tokens).split("delta")[0]
    assert stopped[-3]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert w.cancelled >= 3  # each stop-string stream was ended on the worker


async def test_a_pushed_stream_longer_than_the_stall_bound_is_not_a_stall(tok_dir):
    """While outputs are pushed the request's read stays pending; each pushed output counts
    as a message for the stall watch, so a steady stream outlives the stall bound."""
    w = ScriptedWorker(script=Script(tokens=[70 + i % 50 for i in range(80)], delay_s=0.01),
                       max_model_len=128)
    stall = "stream_stall_timeout_s=0.3, "
    async with workers(w), gateway_process(tok_dir, w.url, config=stall) as url, \
            httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{url}/v1/completions", json={
            "prompt": "x", "max_tokens": 80, "stream": True,
            "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert "error" not in events[-1] and events[-1]["usage"]["completion_tokens"] == 80
    assert w.cancelled == 0


async def test_a_body_that_arrived_whole_is_capped_and_read_without_waiting(tok_dir):
    """uvicorn holds a body that came with its headers: the gateway takes it without a
    deadline (gateway/http_protocol.py's body_arrived), and still refuses one past the cap
    (413) however it was framed; a body still arriving goes the timed way and answers."""
    w = ScriptedWorker(script=Script(tokens=[70, 71]))
    big = json.dumps({"prompt": "x" * 2000, "max_tokens": 2}).encode()
    small = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()

    def exchange(body: bytes, chunked: bool, pause_s: float | None = None) -> bytes:
        framing = (b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                   % (len(body), body) if chunked
                   else b"content-length: %d\r\n\r\n%s" % (len(body), body))
        raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
               b"content-type: application/json\r\n" + framing)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            if pause_s is None:
                s.sendall(raw)
            else:  # the body's end comes after the app began to read
                s.sendall(raw[:len(raw) - 5])
                time.sleep(pause_s)
                s.sendall(raw[len(raw) - 5:])
            head, payload, _ = _read_response(s, b"")
        return head.split(b"\r\n")[0] + b" " + payload

    async with workers(w), gateway_process(tok_dir, w.url,
                                           config="max_request_bytes=1000, ") as url:
        host, port = url.removeprefix("http://").split(":")
        for chunked in (False, True):
            assert b" 413 " in await asyncio.to_thread(exchange, big, chunked)
            for pause_s in (None, 0.3):
                answer = await asyncio.to_thread(exchange, small, chunked, pause_s)
                assert b" 200 " in answer and b'"completion_tokens":2' in answer, answer


async def test_expect_100_continue_gets_its_go_ahead_and_an_answer(tok_dir):
    """curl sends `Expect: 100-continue` with a body over 1 KB (a long prompt) and waits for
    the go-ahead before the body: the body is then not there when the app starts reading,
    and the gateway must ask for it (the timed way) rather than wait for it."""
    w = ScriptedWorker(script=Script(tokens=[70, 71]), max_model_len=4096)
    body = json.dumps({"prompt": "x " * 800, "max_tokens": 2}).encode()

    def exchange() -> tuple[bytes, bytes]:
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                      b"content-type: application/json\r\nexpect: 100-continue\r\n"
                      b"content-length: %d\r\n\r\n" % len(body))
            go = b""
            while b"\r\n\r\n" not in go:  # the go-ahead, before any byte of the body
                more = s.recv(1024)
                assert more, go
                go += more
            s.sendall(body)
            head, payload, _ = _read_response(s, go.split(b"\r\n\r\n", 1)[1])
        return go, head + b" " + payload

    async with workers(w), gateway_process(tok_dir, w.url) as url:
        host, port = url.removeprefix("http://").split(":")
        go, answer = await asyncio.to_thread(exchange)
    assert go.startswith(b"HTTP/1.1 100 Continue"), go
    assert b" 200 " in answer and b'"completion_tokens":2' in answer, answer


async def test_a_client_leaving_mid_body_is_an_abort_not_an_error(tok_dir, tmp_path):
    """Headers and part of the body, then the client closes: the gateway counts an aborted
    request, starts nothing on the workers and logs no error (it used to log a traceback)."""
    w = ScriptedWorker(script=Script(tokens=[70, 71]))
    log = tmp_path / "gateway.log"
    async with workers(w), gateway_process(tok_dir, w.url, log) as url:
        host, port = url.removeprefix("http://").split(":")

        def leave_mid_body() -> None:
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                          b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                          b'{"prompt": ')
                time.sleep(0.3)  # the gateway is waiting for the rest of the body

        await asyncio.to_thread(leave_mid_body)
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                m = (await client.get(f"{url}/metrics")).text
                if 'tandem_requests_total{outcome="aborted"} 1.0' in m:
                    break
                await asyncio.sleep(0.05)
        assert 'tandem_requests_total{outcome="aborted"} 1.0' in m
        assert w.requests == []
    text = log.read_text()
    assert "Traceback" not in text and "unexpected error" not in text, text[-2000:]


def test_the_gateway_freezes_its_heap_once_its_app_has_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gateway/server.py's uvicorn server freezes the startup heap (protocol/gc_heap.py) after
    the app's lifespan started, before it serves; counted here, so this process stays as it
    was."""
    import uvicorn

    from gateway import server as gateway_server

    seen: list[str] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "lifespan":
            message = await receive()  # type: ignore[operator]
            assert message["type"] == "lifespan.startup"
            seen.append("lifespan started")
            await send({"type": "lifespan.startup.complete"})  # type: ignore[operator]
            await receive()  # type: ignore[operator]
            await send({"type": "lifespan.shutdown.complete"})  # type: ignore[operator]

    monkeypatch.setattr(gateway_server, "freeze_startup_heap", lambda: seen.append("frozen"))
    server = gateway_server._Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                   log_level="warning"))

    async def run() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await task

    asyncio.run(asyncio.wait_for(run(), 20))
    assert seen == ["lifespan started", "frozen"]


def test_sigterm_during_the_startup_wait_stops_the_gateway(tok_dir, tmp_path) -> None:
    """A gateway waiting for its workers at start-up (gateway.startup_wait_s) stops on SIGTERM
    at once, as a pod being deleted must: it went on waiting out the 30 s first (a Kubernetes
    grace period is 30 s by default, then SIGKILL)."""
    port, nobody = free_port(), free_port()  # no worker answers there
    code = (
        "from gateway.config import GatewayConfig; from gateway.server import run_gateway; "
        f"run_gateway(GatewayConfig(port={port}, workers=('127.0.0.1:{nobody}',), "
        f"model_path={str(tok_dir)!r}, startup_wait_s=30, log_level='info'))"
    )
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while "Waiting for application startup" not in log.read_text():  # in the wait
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
