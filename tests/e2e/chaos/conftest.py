"""Shared helpers of the chaos drills: process handles, health, a request driver that records
how every request ended, and the figures table (`docs/reliability.md` reproduces it).

Every drill states what "ended" means: a 200 with its whole body (`ok`), or an OpenAI-shaped
error the client received (`error`, with the time it took); a request still open after its
client deadline is `hung`, which every drill asserts is zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster

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


@dataclass
class Outcomes:
    """How a drill's requests ended."""

    ok: int = 0
    error: int = 0
    hung: int = 0
    aborted: int = 0  # the client itself left (abort storm)
    started: int = 0  # answers whose first bytes reached the client (a stream under way)
    error_after_s: list[float] = field(default_factory=list)  # fault (or request start) -> error
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, other: Outcomes) -> None:
        self.ok += other.ok
        self.error += other.error
        self.hung += other.hung
        self.aborted += other.aborted
        self.started += other.started
        self.error_after_s += other.error_after_s
        for k, v in other.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + v

    @property
    def max_error_s(self) -> float:
        return max(self.error_after_s, default=0.0)


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


@dataclass
class Row:
    fault: str
    topology: str
    outcomes: Outcomes
    pages_leaked: int
    recover_s: float | None  # fault -> the gateway routes to the worker again (None: n/a)

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        o = d["outcomes"]
        outcomes = Outcomes(**{**o, "statuses": {int(k): v for k, v in o["statuses"].items()}})
        return cls(**{**d, "outcomes": outcomes})


_ROWS = pytest.StashKey[list[Row]]()


def _rows(config: pytest.Config) -> list[Row]:
    return config.stash.setdefault(_ROWS, [])


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[Row], None]:
    """Add a drill's figures to the table printed at the end of the session (and written to
    $TANDEM_CHAOS_REPORT)."""
    return _rows(request.config).append


def leaked_pages(cluster: Cluster, timeout_s: float = 30.0) -> int:
    """Pages still used on surviving workers once they should have drained (0 is the only pass)."""
    try:
        cluster.wait_drained(timeout_s=timeout_s)
        return 0
    except AssertionError:
        return sum(cluster.load(n).kv_used_pages for n in cluster.workers)


def table(rows: list[Row]) -> str:
    lines = [
        "| fault | topology | ok | error | hung | max time to error (s) | pages leaked "
        "| recover (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r.outcomes
        rec = "-" if r.recover_s is None else f"{r.recover_s:.1f}"
        err = f"{o.error}" + (f" (+{o.aborted} client aborts)" if o.aborted else "")
        lines.append(
            f"| {r.fault} | {r.topology} | {o.ok} | {err} | {o.hung} | {o.max_error_s:.2f} | "
            f"{r.pages_leaked} | {rec} |"
        )
    return "\n".join(lines)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist a worker hands its rows to the controller, which prints the table."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["chaos_rows"] = json.dumps([r.to_json() for r in _rows(session.config)])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    rows = getattr(node, "workeroutput", {}).get("chaos_rows")
    if rows:
        _rows(node.config).extend(Row.from_json(r) for r in json.loads(rows))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    rows = _rows(terminalreporter.config)
    if not rows:
        return
    terminalreporter.write_sep("=", "chaos drills")
    terminalreporter.write_line(table(rows))
    path = os.environ.get("TANDEM_CHAOS_REPORT")
    if path:
        Path(path).write_text(table(rows) + "\n" + json.dumps([r.fault for r in rows]) + "\n")
