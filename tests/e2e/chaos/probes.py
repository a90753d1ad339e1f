"""Client-side probes of partial failure: what clients of a real cluster see when one worker
freezes, when KV writes fail, when decode is full, and when sockets sit idle.

Each probe drives the cluster over HTTP the way an operator's load would and returns the
figures of docs/reliability.md's before/after table; the chaos tests assert on them and
`python -m bench.reliability` prints them. Nothing here imports the gateway or the workers:
only HTTP, signals and the workers' GetLoad (through `Cluster`), so the same probes run
against older code for the "before" column.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from orchestrator.launch.background import Cluster

Payload = dict[str, object]


@dataclass
class Call:
    """One request as its client saw it."""

    start: float
    end: float = 0.0
    status: int = 0  # HTTP status; 0 = the connection broke or the client deadline passed
    ok: bool = False  # a whole answer: 200, a real finish_reason, a stream ending in [DONE]
    empty_abort: bool = False  # a 200 whose finish_reason is "abort": an answer that is not one
    hung: bool = False  # still open at the client deadline
    finish_reason: str = ""
    token_times: list[float] = field(default_factory=list)  # stream: events that carried text

    @property
    def failed(self) -> bool:
        return not self.ok

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def payload(prompt: str, max_tokens: int, stream: bool, model: str) -> Payload:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream}


def _finish_of(obj: dict[str, object]) -> str:
    choices = obj.get("choices") or []
    if choices and isinstance(choices, list):
        return str(choices[0].get("finish_reason") or "")
    return ""


async def call(client: httpx.AsyncClient, body: Payload, deadline_s: float) -> Call:
    """Send one completion request and file how it ended."""
    c = Call(start=time.monotonic())
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                c.status = r.status_code
                if body.get("stream") and r.status_code == 200:
                    await _read_stream(r, c)
                else:
                    text = await r.aread()
                    obj = json.loads(text) if text else {}
                    c.finish_reason = _finish_of(obj)
                    c.ok = r.status_code == 200 and c.finish_reason in ("stop", "length")
    except TimeoutError:
        c.hung = True
    except (httpx.TransportError, json.JSONDecodeError):
        c.status = c.status or 0
    c.end = time.monotonic()
    c.empty_abort = c.status == 200 and c.finish_reason == "abort"
    return c


async def _read_stream(r: httpx.Response, c: Call) -> None:
    done = error = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            error = True
            continue
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            c.token_times.append(time.monotonic())
        c.finish_reason = _finish_of(obj) or c.finish_reason
    c.ok = done and not error and c.finish_reason in ("stop", "length")


def client(url: str, concurrency: int, timeout_s: float = 120.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)


async def loop_clients(url: str, n: int, stop_at: float, make: Callable[[int, int], Payload],
                       deadline_s: float, out: list[Call]) -> None:
    """`n` clients, each sending one request after another until `stop_at` (monotonic)."""
    async with client(url, n, deadline_s + 5) as cl:
        async def one(k: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                out.append(await call(cl, make(k, i), deadline_s))
                i += 1
        await asyncio.gather(*(one(k) for k in range(n)))


async def burst(url: str, bodies: list[Payload], concurrency: int,
                deadline_s: float) -> list[Call]:
    out: list[Call] = []
    sem = asyncio.Semaphore(concurrency)
    async with client(url, concurrency, deadline_s + 5) as cl:
        async def one(b: Payload) -> None:
            async with sem:
                out.append(await call(cl, b, deadline_s))
        await asyncio.gather(*(one(b) for b in bodies))
    return out


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    total = 0.0
    for m in pat.finditer(text):
        if all(part in (m.group(1) or "") for part in labels.split(",") if part):
            total += float(m.group(2))
    return total


# ---- the freeze probe ----------------------------------------------------------------------


@dataclass
class Freeze:
    rps_before: float
    rps_during: float
    max_error_s: float  # freeze (or request start, if later) -> the client's error
    stalled_streams: int  # mid-answer at the freeze, then no token for over a second
    stall_error_s: float  # the freeze -> the last such stream's error (0: none erred)
    stall_resumed: int  # such streams that waited the freeze out instead of erring
    empty_200: int
    hung: int
    rejoin_s: float  # SIGCONT -> the gateway routes to the worker again (inf: never)
    stuck_rooms: int  # prefill rooms TRANSFERRING just before SIGCONT (head-of-line blocked)
    slowest_ok_s: float  # the longest successful short request that overlapped the freeze
    calls: list[Call]


def _arith(k: int, i: int, n: int = 10) -> str:
    """`n` assignments (5 tokens each with the embedded model's character tokenizer)."""
    return "".join(f"{chr(97 + (k + j) % 26)}={(i * 7 + j) % 100:02d};" for j in range(n)) + "\n"


def _stalled(x: Call, at: float) -> bool:
    """A stream mid-answer at `at` whose next event came over a second later (or never)."""
    before = [t for t in x.token_times if t < at]
    after = [t for t in x.token_times if t >= at]
    nxt = after[0] if after else x.end
    return bool(before) and x.end > at and nxt - at > 1.0


async def freeze_probe(c: Cluster, model: str, *, victim: str = "decode-0", clients: int = 16,
                       streams: int = 8, baseline_s: float = 10.0, freeze_s: float = 15.0,
                       after_s: float = 6.0, deadline_s: float = 90.0) -> Freeze:
    """Steady load (prompts of ~300 tokens, so prefill queues rooms that decode registered),
    then SIGSTOP `victim` for `freeze_s`, then SIGCONT."""
    role, replica = victim.rsplit("-", 1)
    pid = c.pid(role, int(replica))
    calls: list[Call] = []
    t0 = time.monotonic()
    frozen_at = t0 + baseline_s + 3.0  # 3 s of warm-up first
    stop_at = frozen_at + freeze_s + after_s

    def short(k: int, i: int) -> Payload:
        return payload(_arith(k, i, 60) + "a?", 8, False, model)

    def long(k: int, i: int) -> Payload:
        return payload(_arith(k + 13, i, 40), 120, True, model)

    prefills = [n for n in c.workers if n.startswith("prefill")]
    stuck: list[int] = []

    def transferring() -> int:
        return sum(c.load(n).rooms.get("TRANSFERRING", 0) for n in prefills)

    at: list[float] = []  # when the signal really went (the loop may wake late under load)

    async def signals() -> float:
        await asyncio.sleep(frozen_at - time.monotonic())
        os.kill(pid, signal.SIGSTOP)
        at.append(time.monotonic())
        try:
            await asyncio.sleep(freeze_s - 1.0)
            stuck.append(await asyncio.to_thread(transferring))
            await asyncio.sleep(at[0] + freeze_s - time.monotonic())
        finally:
            os.kill(pid, signal.SIGCONT)
        cont = time.monotonic()
        url = c.workers[victim]
        deadline = cont + 60.0
        while time.monotonic() < deadline:
            if await asyncio.to_thread(c.healthy, url):
                return time.monotonic() - cont
            await asyncio.sleep(0.1)
        return float("inf")

    _, _, rejoin = await asyncio.gather(
        loop_clients(c.url, clients, stop_at, short, deadline_s, calls),
        loop_clients(c.url, streams, stop_at, long, deadline_s, calls),
        signals())
    frozen_at = at[0]
    before = [x for x in calls if frozen_at - baseline_s <= x.end < frozen_at and x.ok]
    during = [x for x in calls if frozen_at <= x.end < frozen_at + freeze_s and x.ok]
    errors = [x.end - max(x.start, frozen_at) for x in calls if x.failed and not x.hung
              and x.end >= frozen_at]
    stalled = [x for x in calls if _stalled(x, frozen_at)]
    stall_err = [x.end - frozen_at for x in stalled if x.failed]
    return Freeze(rps_before=len(before) / baseline_s, rps_during=len(during) / freeze_s,
                  max_error_s=max(errors, default=0.0), stalled_streams=len(stalled),
                  stall_error_s=max(stall_err, default=0.0),
                  stall_resumed=sum(x.ok for x in stalled),
                  empty_200=sum(x.empty_abort for x in calls), hung=sum(x.hung for x in calls),
                  rejoin_s=rejoin, stuck_rooms=stuck[0] if stuck else -1,
                  slowest_ok_s=max((x.end - x.start for x in calls if x.ok and not x.token_times
                                    and x.end > frozen_at and x.start < frozen_at + freeze_s),
                                   default=0.0), calls=calls)


# ---- faults, overload, sockets --------------------------------------------------------------


@dataclass
class Faults:
    ok: int
    errors: int
    empty_200: int
    hung: int
    metrics_success: float  # the gateway's tandem_requests_total{outcome="success"} delta
    metrics_errors: float  # client_error + rejected + server_error delta
    statuses: dict[int, int]


async def faults_probe(url: str, model: str, n: int = 300, concurrency: int = 16) -> Faults:
    """`n` requests (half streamed) through a cluster whose KV writes fail at random."""
    m0 = metric(url, "tandem_requests_total", 'outcome="success"')
    e0 = sum(metric(url, "tandem_requests_total", f'outcome="{o}"')
             for o in ("client_error", "rejected", "server_error"))
    bodies = [payload(_arith(i, i) + "b?", 6, i % 2 == 0, model) for i in range(n)]
    calls = await burst(url, bodies, concurrency, 60.0)
    statuses: dict[int, int] = {}
    for x in calls:
        statuses[x.status] = statuses.get(x.status, 0) + 1
    e1 = sum(metric(url, "tandem_requests_total", f'outcome="{o}"')
             for o in ("client_error", "rejected", "server_error"))
    return Faults(ok=sum(x.ok for x in calls), errors=sum(x.failed for x in calls),
                  empty_200=sum(x.empty_abort for x in calls), hung=sum(x.hung for x in calls),
                  metrics_success=metric(url, "tandem_requests_total", 'outcome="success"') - m0,
                  metrics_errors=e1 - e0, statuses=statuses)


@dataclass
class Overload:
    ok: int
    errors: int
    max_gap_s: float  # the longest wait between two events of one stream
    p99_gap_s: float
    gaps_over_1s: int
    ttft_p50_s: float
    ttft_max_s: float
    wall_s: float
    statuses: dict[int, int]


async def overload_probe(url: str, model: str, n: int = 300, max_tokens: int = 200) -> Overload:
    """`n` streams at once, each `max_tokens` long: far more than decode has seats for."""
    bodies = [payload(_arith(i, i), max_tokens, True, model) for i in range(n)]
    t0 = time.monotonic()
    calls = await burst(url, bodies, n, 600.0)
    gaps = sorted(g for x in calls for g in x.gaps())
    ttft = sorted(x.token_times[0] - x.start for x in calls if x.token_times)
    return Overload(ok=sum(x.ok for x in calls), errors=sum(x.failed for x in calls),
                    max_gap_s=gaps[-1] if gaps else 0.0,
                    p99_gap_s=gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0,
                    gaps_over_1s=sum(g > 1.0 for g in gaps),
                    ttft_p50_s=statistics.median(ttft) if ttft else 0.0,
                    ttft_max_s=ttft[-1] if ttft else 0.0, wall_s=time.monotonic() - t0,
                    statuses={s: sum(x.status == s for x in calls)
                              for s in {x.status for x in calls}})


@dataclass
class Sockets:
    opened: int
    closed_idle: int  # of the idle sockets, closed by the gateway within `watch_s`
    closed_partial: int  # of the half-header sockets
    got_408: int  # half-header sockets that were answered 408 before the close
    last_close_s: float  # open -> the last socket the gateway closed
    normal_ok: int
    normal_sent: int


def _closed(s: socket.socket) -> tuple[bool, bool]:
    """(closed by the peer, saw a 408); non-blocking."""
    try:
        data = s.recv(4096)
    except BlockingIOError:
        return False, False
    except OSError:
        return True, False
    return True, b" 408 " in data[:20] if data else False


def sockets_probe(url: str, model: str, idle: int = 500, partial: int = 500,
                  watch_s: float = 40.0) -> Sockets:
    """Open `idle` sockets that send nothing and `partial` ones that send half a header, then
    send normal requests meanwhile; watch which sockets the gateway closes, and when."""
    host, port = url.removeprefix("http://").split(":")
    socks: list[tuple[socket.socket, bool]] = []
    t0 = time.monotonic()
    for i in range(idle + partial):
        s = socket.create_connection((host, int(port)), timeout=5)
        if i >= idle:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: applic")
        s.setblocking(False)
        socks.append((s, i >= idle))
    normal = [payload("a=1;\na?", 2, False, model) for _ in range(20)]
    sent = len(normal)
    ok = sum(x.ok for x in asyncio.run(burst(url, normal, 4, 30.0)))
    closed: dict[int, float] = {}
    got_408 = 0
    while time.monotonic() - t0 < watch_s and len(closed) < len(socks):
        for i, (s, _) in enumerate(socks):
            if i in closed:
                continue
            done, is_408 = _closed(s)
            if done:
                closed[i] = time.monotonic() - t0
                got_408 += is_408
        time.sleep(0.1)
    for s, _ in socks:
        s.close()
    return Sockets(opened=len(socks), closed_idle=sum(1 for i in closed if not socks[i][1]),
                   closed_partial=sum(1 for i in closed if socks[i][1]), got_408=got_408,
                   last_close_s=max(closed.values(), default=0.0), normal_ok=ok,
                   normal_sent=sent)
