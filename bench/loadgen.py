"""The load generator of the gateway benches: wrk (C, one thread) when installed, else aiohttp.

`http_load(url, body, requests, concurrency)` sends `requests` POSTs of `body` (JSON) from
`concurrency` keep-alive connections and returns the median latency, requests/s and the
number of failed answers. wrk spends a few microseconds a request, so on a 2-core box it
leaves the gateway (and the routers it is compared with) nearly a core; the aiohttp
fallback costs ~100 us a request and shares the box with what it measures.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_LUA = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
"""
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass(frozen=True)
class Load:
    p50_s: float  # median request latency
    rps: float  # completed requests per second
    failed: int  # non-200 answers and socket errors
    tool: str  # wrk | aiohttp
    count: int  # requests completed in the call, wrk's sizing run included (for CPU per request)


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m)", text)
    assert m is not None, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk_load(url: str, body: str, requests: int, concurrency: int) -> Load:
    """wrk runs for a time, not a count: a one-second run sizes the one measured (about
    `requests` requests, 2 to 30 seconds)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_LUA.format(body=body))
    try:
        probe = _wrk(url, f.name, concurrency, 1.0)
        seconds = max(2.0, min(30.0, requests / max(probe.rps, 1.0)))
        run = _wrk(url, f.name, concurrency, seconds)
        return Load(run.p50_s, run.rps, probe.failed + run.failed, "wrk", probe.count + run.count)
    finally:
        Path(f.name).unlink()


def _wrk(url: str, script: str, concurrency: int, seconds: float) -> Load:
    argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--latency",
            "-s", script, url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                         check=True).stdout
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    rps = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    assert p50 is not None and rps is not None, out
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = (int(bad.group(1)) if bad else 0) + (sum(map(int, sock.groups())) if sock else 0)
    done = re.search(r"(\d+) requests in", out)
    assert done is not None, out
    return Load(_seconds(p50.group(1)), float(rps.group(1)), failed, "wrk", int(done.group(1)))


async def _aiohttp_load(url: str, body: str, requests: int, concurrency: int) -> Load:
    import aiohttp

    lat: list[float] = []
    failed = 0
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def client(k: int) -> None:
            nonlocal failed
            for _ in range(k):
                t = time.perf_counter()
                async with s.post(url, data=body, headers=headers) as r:
                    await r.read()
                    failed += r.status != 200
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(requests // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Load(statistics.median(lat), len(lat) / wall, failed, "aiohttp", len(lat))


def http_load(url: str, body: str, requests: int, concurrency: int) -> Load:
    if shutil.which("wrk"):
        return wrk_load(url, body, requests, concurrency)
    return asyncio.run(_aiohttp_load(url, body, requests, concurrency))
