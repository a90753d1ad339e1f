"""Connection hygiene of the real gateway process (uvicorn + gateway/connections.py): idle and
half-header sockets are closed within the header deadline (408 when a request had begun),
idle kept-alive connections after the keep-alive timeout, connections past the bound get
503, and normal requests are served meanwhile."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import free_ports
from tests.gateway.gw_tokenizers import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
HEADER_S, KEEPALIVE_S, MAX_CONNS = 1.0, 1.0, 600
BODY_BUFFER = 8 * 1024 * 1024  # two 4 MiB bodies (max_request_bytes) being read at once

GATEWAY = """
import sys
from gateway.config import GatewayConfig
from gateway.server import run_gateway
port, worker, tok = int(sys.argv[1]), sys.argv[2], sys.argv[3]
run_gateway(GatewayConfig(port=port, workers=(worker,), model_path=tok, log_level="warning",
                          header_timeout_s=float(sys.argv[4]),
                          keepalive_timeout_s=float(sys.argv[5]),
                          max_connections=int(sys.argv[6]),
                          max_body_buffer_bytes=int(sys.argv[7])))
"""


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    wport, gport = free_ports(2)
    worker = subprocess.Popen([sys.executable, "-m", "bench.mock_worker", "--grpc-port",
                               str(wport)], cwd=ROOT)
    gw = subprocess.Popen([sys.executable, "-c", GATEWAY, str(gport), f"127.0.0.1:{wport}",
                           str(tok), str(HEADER_S), str(KEEPALIVE_S), str(MAX_CONNS),
                           str(BODY_BUFFER)], cwd=ROOT)
    url = f"http://127.0.0.1:{gport}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.1)
        yield url
    finally:
        for p in (gw, worker):
            p.terminate()
            p.wait(timeout=30)


def _open(url: str, n: int, partial: bool) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=5)
        if partial:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Ty")
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket, wait_s: float) -> bytes | None:
    """What the gateway sent before closing (b"" if nothing), or None if still open."""
    s.settimeout(wait_s)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except OSError:
        pass
    return data


def _complete(url: str) -> int:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=10)
    return r.status_code


def test_idle_and_half_header_sockets_are_closed_while_requests_succeed(gateway_url: str) -> None:
    t0 = time.monotonic()
    idle = _open(gateway_url, 200, partial=False)
    half = _open(gateway_url, 200, partial=True)
    assert [_complete(gateway_url) for _ in range(10)] == [200] * 10  # served meanwhile
    for s in idle:
        assert _closed_by_peer(s, HEADER_S + 2.0) == b"", "an idle socket stayed open"
    for s in half:
        got = _closed_by_peer(s, 1.0)
        assert got is not None, "a half-header socket stayed open"
        assert got.startswith(b"HTTP/1.1 408 "), got[:60]
        assert b"header_timeout_s" in got
    assert time.monotonic() - t0 < HEADER_S + 4.0
    for s in idle + half:
        s.close()


def test_idle_keepalive_connection_closes(gateway_url: str) -> None:
    host, port = gateway_url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first:
        first += s.recv(4096)
    head, _, body = first.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head[:40]
    t0 = time.monotonic()
    assert _closed_by_peer(s, KEEPALIVE_S + 2.0) == b""
    assert time.monotonic() - t0 >= KEEPALIVE_S * 0.8
    s.close()


def test_connections_past_the_bound_get_503(gateway_url: str) -> None:
    held = _open(gateway_url, MAX_CONNS, partial=False)
    try:
        extra = _open(gateway_url, 1, partial=False)[0]
        got = _closed_by_peer(extra, 2.0)
        assert got is not None and got.startswith(b"HTTP/1.1 503 "), got
        assert b"max_connections" in got
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while _complete(gateway_url) != 200:  # served again once the sockets are gone
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _answer(url: str, raw: bytes) -> bytes:
    """What the gateway answers to `raw` (sent whole) before closing the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(raw)
        got = _closed_by_peer(s, 5.0)
    assert got is not None, "the gateway kept the connection open"
    return got


def test_oversized_headers_get_431_and_close(gateway_url: str) -> None:
    # httptools buffers a header without bound: 146 MB sent in 8 s grew the gateway by 83 MB
    # before the header deadline struck, and max_connections such sockets would exhaust memory
    got = _answer(gateway_url, b"GET /health HTTP/1.1\r\nHost: gw\r\nX-A: "
                  + b"a" * (256 * 1024) + b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 431 "), got[:80]
    assert b'"type": "invalid_request_error"' in got and b"max_header_bytes" in got
    assert _complete(gateway_url) == 200


def test_unparseable_request_gets_an_openai_shaped_400(gateway_url: str) -> None:
    got = _answer(gateway_url, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, head
    assert b'"type": "invalid_request_error"' in body and b'"code": "invalid_http"' in body


def test_bodies_held_unfinished_are_bounded_in_all(gateway_url: str) -> None:
    # Each unfinished body was buffered up to max_request_bytes until body_timeout_s: 400
    # sockets with 4 MB of a body each grew the gateway by 1.3 GB (max_connections x 4 MiB,
    # 16 GiB by default, was the bound). Past max_body_buffer_bytes in all: 503 and Retry-After.
    host, port = gateway_url.removeprefix("http://").split(":")
    part = b'{"prompt": "' + b"a" * (3 * 1024 * 1024)
    held = []
    for _ in range(3):  # 9 MiB of bodies being read, past the 8 MiB bound
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (4 * 1024 * 1024, part))
        held.append(s)
    try:
        answers = [_closed_by_peer(s, 1.5) for s in held]
        busy = [a for a in answers if a is not None and a.startswith(b"HTTP/1.1 503 ")]
        assert len(busy) >= 1, [a[:60] if a else a for a in answers]
        assert b"max_body_buffer_bytes" in busy[0] and b"retry-after: 1" in busy[0].lower()
    finally:
        for s in held:
            s.close()
    assert _complete(gateway_url) == 200
