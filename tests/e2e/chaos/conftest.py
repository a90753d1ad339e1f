"""Shared helpers of the chaos drills: process handles, health, a request driver that records
how every request ended, and the figures table (`docs/reliability.md` reproduces it).

Every drill states what "ended" means: a 200 with its whole body (`ok`), or an OpenAI-shaped
error the client received (`error`, with the time it took); a request still open after its
client deadline is `hung`, which every drill asserts is zero.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster
from tests.e2e.chaos.report import Outcomes, Row, rows

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
CLIENT_DEADLINE_S = 30.0  # a request open longer than this counts as hung


def wait_health(cluster: Cluster, url: str, want: bool, timeout_s: float) -> float:
    """Wait until the gateway marks `url` healthy (or not); returns when it did (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while cluster.healthy(url) != want:
        assert time.monotonic() < deadline, (
            f"{url} still {'un' if want else ''}healthy after {timeout_s}s"
        )
        time.sleep(0.05)
    return time.monotonic()


def body(prompt: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL.name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def one_request(
    client: httpx.AsyncClient, payload: dict[str, object], since: list[float], out: Outcomes
) -> None:
    """Send one request and file its ending. `since[0]`: the fault's time (errors are timed from it,
    or from the request's start if later)."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(CLIENT_DEADLINE_S):
            async with client.stream("POST", "/v1/completions", json=payload) as r:
                out.statuses[r.status_code] = out.statuses.get(r.status_code, 0) + 1
                parts: list[bytes] = []
                async for part in r.aiter_bytes():
                    out.started += not parts
                    parts.append(part)
                text = b"".join(parts).decode(errors="replace")
    except TimeoutError:
        out.hung += 1
        return
    except httpx.TransportError:  # the connection broke: the client did hear about it
        text, r = '{"error": "transport"}', None
    failed = r is None or r.status_code != 200 or '"error"' in text
    if not failed and payload.get("stream") and "[DONE]" not in text:
        failed = True  # a stream that stopped without its end is no success
    if failed:
        out.error += 1
        out.error_after_s.append(time.monotonic() - max(t0, since[0]))
    else:
        out.ok += 1


async def drive(
    url: str, payloads: list[dict[str, object]], concurrency: int, since: list[float],
    out: Outcomes | None = None,
) -> Outcomes:
    """Send `payloads`, at most `concurrency` at a time; `out` (filled as they go) lets another
    thread watch their progress."""
    out = Outcomes() if out is None else out
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=CLIENT_DEADLINE_S + 5, limits=limits
    ) as client:

        async def guarded(p: dict[str, object]) -> None:
            async with sem:
                await one_request(client, p, since, out)

        await asyncio.gather(*(guarded(p) for p in payloads))
    return out


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[Row], None]:
    """Add a drill's figures to the table printed at the end of the session (and written to
    $TANDEM_CHAOS_REPORT)."""
    return rows(request.config).append


def leaked_pages(cluster: Cluster, timeout_s: float = 30.0) -> int:
    """Pages still used on surviving workers once they should have drained (0 is the only pass)."""
    try:
        cluster.wait_drained(timeout_s=timeout_s)
        return 0
    except AssertionError:
        return sum(cluster.load(n).kv_used_pages for n in cluster.workers)


