"""Load: 1000 concurrent streaming requests through the gateway to the tiny 1P1D cluster.

All complete (each stream ends with its finish_reason and [DONE]), none is lost, the gateway's
memory stays bounded, and the figures are printed: wall time, client TTFT p50/p99, the
gateway's CPU time per request (its own overhead, whatever the workers take) and its peak RSS.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
NUM_REQUESTS = 1000
MAX_TOKENS = 4
RSS_GROWTH_LIMIT_MB = 300  # 1000 open streams; a leak of a few hundred KB per request fails this

pytestmark = pytest.mark.slow


def gateway_pid(c: Cluster) -> int:
    out = subprocess.run(
        ["pgrep", "-f", f"gateway --config {c.log_dir / 'cluster.yaml'}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert len(out) == 1, f"expected one gateway process, found {out}"
    return int(out[0])


def proc_stats(pid: int) -> tuple[float, float, float]:
    """(RSS MB, peak RSS MB, CPU seconds) of a process, from /proc."""
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":" in line
    )
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return int(status["VmRSS"].split()[0]) / 1024, int(status["VmHWM"].split()[0]) / 1024, cpu


async def stream_all(url: str) -> tuple[int, list[float], list[str]]:
    ttfts: list[float] = []
    failures: list[str] = []
    done = 0
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal done
            body = {
                "model": MODEL.name,
                "prompt": f"v{i % 97}=3;\nv{i % 97}?",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.monotonic()
            first, finished = None, False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if first is None and '"text"' in line:
                            first = time.monotonic() - t0
                        finished = finished or '"finish_reason":"length"' in line.replace(" ", "")
                        if line == "data: [DONE]":
                            break
                        if '"error"' in line:
                            failures.append(line[:200])
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                return
            if first is not None and finished:
                ttfts.append(first)
                done += 1
            else:
                failures.append(f"request {i}: stream ended without its finish (first={first})")

        await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    return done, ttfts, failures


def test_thousand_concurrent_streams(tmp_path: Path) -> None:
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path, model=MODEL) as c:
        pid = gateway_pid(c)
        httpx.post(
            f"{c.url}/v1/completions",
            json={"model": MODEL.name, "prompt": "a=1;", "max_tokens": 2},
            timeout=60,
        ).raise_for_status()  # first-request costs out of the way
        rss0, _, cpu0 = proc_stats(pid)
        t0 = time.monotonic()
        done, ttfts, failures = asyncio.run(stream_all(c.url))
        wall = time.monotonic() - t0
        rss1, peak, cpu1 = proc_stats(pid)
        c.wait_drained(timeout_s=60)
    assert not failures, f"{len(failures)} failed, first: {failures[:3]}"
    assert done == NUM_REQUESTS, f"{NUM_REQUESTS - done} requests lost"
    q = statistics.quantiles(ttfts, n=100)
    cpu_ms = (cpu1 - cpu0) * 1e3 / NUM_REQUESTS
    print(
        f"\nload: {NUM_REQUESTS} streams in {wall:.1f}s ({NUM_REQUESTS / wall:.0f} req/s); TTFT "
        f"p50 {q[49] * 1e3:.0f} ms p99 {q[98] * 1e3:.0f} ms; gateway CPU {cpu_ms:.2f} ms/request; "
        f"gateway RSS {rss0:.0f} -> {rss1:.0f} MB (peak {peak:.0f} MB)"
    )
    assert peak - rss0 < RSS_GROWTH_LIMIT_MB, f"gateway RSS grew {peak - rss0:.0f} MB under load"
