"""Chaos drills on real clusters (`make chaos`): workers killed mid-transfer and mid-stream,
restarted on their port, an abort storm, and transfer faults from TANDEM_TRANSFER_FAULTS.

For every drill: each request ends (ok, or an error the client receives within a deadline;
none hangs), every surviving worker holds zero pages and rooms afterwards, and the gateway
routes around a dead worker and takes it back when the launcher has restarted it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import Cluster, running_cluster
from tests.e2e.chaos.conftest import MODEL, body, drive, leaked_pages, wait_health
from tests.e2e.chaos.report import Outcomes, Row

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

DEADLINES = (
    "transfer.bootstrap_timeout_s=3",
    "transfer.waiting_timeout_s=10",
    "transfer.transfer_timeout_s=2",
)
ERROR_WITHIN_S = 10.0  # a client of a dead worker hears its error within this


@pytest.fixture(scope="module")
def cluster_2p2d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """2P2D; the launcher restarts a dead worker on its port; every KV write is slowed by
    300 ms, so a kill lands while rooms are mid-transfer."""
    # Writes are held 300 ms each; a generous transfer deadline keeps this drill about kills,
    # not about the deadline (which fences a peer whose writes outlive it: test_partial_failure).
    overrides = (
        "launcher.on_worker_exit=restart",
        "launcher.max_restarts=4",
        "gateway.health_interval_s=0.3",
        *DEADLINES,
        "transfer.transfer_timeout_s=10",
    )
    with running_cluster(
        "configs/tiny-2p2d.yaml",
        *overrides,
        tmp=tmp_path_factory.mktemp("chaos2p2d"),
        model=MODEL,
        env={"TANDEM_TRANSFER_FAULTS": "delay_ms=300"},
    ) as c:
        yield c


def _run(
    url: str, payloads: list[dict[str, object]], concurrency: int, since: list[float],
    out: Outcomes | None = None,
) -> Outcomes:
    return asyncio.run(drive(url, payloads, concurrency, since, out))


def _kill_during(
    c: Cluster, role: str, payloads: list[dict[str, object]], ready: str
) -> tuple[Outcomes, float, float]:
    """Send `payloads`, SIGKILL `role`-0 once it is busy (`ready`: transferring | running), wait for
    every request; returns (outcomes, kill time, time the gateway took it back).

    "running" also waits until more than half the streams have their first bytes, so at least
    one of the killed worker's streams is under way: one killed before its first token is
    retried on another pair and succeeds (docs/reliability.md), which is no mid-stream kill."""
    name, url = f"{role}-0", c.workers[f"{role}-0"]
    since = [float("inf")]
    result: list[Outcomes] = []
    progress = Outcomes()
    t = threading.Thread(
        target=lambda: result.append(_run(c.url, payloads, 16, since, progress)))
    t.start()
    deadline = time.monotonic() + 60
    while True:
        ld = c.load(name)
        if ready == "transferring":
            busy = ld.rooms.get("TRANSFERRING", 0) > 0
        elif ready == "answering":  # JSON answers: decoding for a while, none finished yet
            busy = ld.running > 1 and progress.ok == 0
            if busy:
                time.sleep(1.0)
        else:
            busy = ld.running > 0 and progress.started > len(payloads) // 2
        if busy:
            break
        assert time.monotonic() < deadline, f"{name} never became busy ({ready})"
        time.sleep(0.01)
    os.kill(c.pid(role, 0), signal.SIGKILL)
    since[0] = killed = time.monotonic()
    wait_health(c, url, want=False, timeout_s=10)
    # Routed around: new requests succeed while it is down.
    for _ in range(3):
        r = httpx.post(f"{c.url}/v1/completions", json=body("a=1;\na?", 2, False), timeout=60)
        assert r.status_code == 200, r.text
    t.join(timeout=120)
    assert result, "the request driver did not finish"
    back = wait_health(c, url, want=True, timeout_s=120)
    return result[0], killed, back


def _served_by(c: Cluster, name: str) -> None:
    """The rejoined worker takes requests again."""
    before = c.load(name).transfer_pages
    deadline = time.monotonic() + 30
    i = 0
    while c.load(name).transfer_pages == before:
        assert time.monotonic() < deadline, f"{name} took no request after rejoining"
        # A new prefix each time: cache-aware routing keeps a repeated prompt where it is cached.
        prompt = f"{chr(97 + i % 26)}={i % 100:02d};" * 8
        httpx.post(
            f"{c.url}/v1/completions", json=body(prompt, 2, False), timeout=60
        ).raise_for_status()
        i += 1


def _check(o: Outcomes, leaked: int) -> None:
    assert o.hung == 0, f"{o.hung} requests hung"
    assert o.max_error_s < ERROR_WITHIN_S, f"a client waited {o.max_error_s:.1f}s for its error"
    assert leaked == 0, f"{leaked} pages leaked"


def test_kill_prefill_mid_transfer(cluster_2p2d: Cluster, record: Callable[[Row], None]) -> None:
    c = cluster_2p2d
    payloads = [body(f"p{i}=3;" * 40, 8, i % 2 == 0) for i in range(24)]
    o, killed, back = _kill_during(c, "prefill", payloads, ready="transferring")
    leaked = leaked_pages(c)
    record(Row("SIGKILL prefill mid-transfer", "2P2D", o, leaked, back - killed))
    _check(o, leaked)
    assert o.ok + o.error == len(payloads)
    _served_by(c, "prefill-0")


def test_kill_decode_mid_stream(cluster_2p2d: Cluster, record: Callable[[Row], None]) -> None:
    c = cluster_2p2d
    # 400 tokens (of the model's 512 positions): streams long enough to be killed mid-way.
    payloads = [body(f"d{i}=4;" * 10, 400, True) for i in range(8)]
    o, killed, back = _kill_during(c, "decode", payloads, ready="running")
    leaked = leaked_pages(c)
    record(Row("SIGKILL decode mid-stream", "2P2D", o, leaked, back - killed))
    _check(o, leaked)
    assert o.error > 0, "no stream on the killed decode worker reported an error"
    _served_by(c, "decode-0")


def test_kill_decode_mid_answer(cluster_2p2d: Cluster, record: Callable[[Row], None]) -> None:
    """Non-streamed answers whose decode worker dies mid-way: the clients have seen nothing, so
    each runs again on the other pair (RequestRun.restart) and every one answers 200."""
    c = cluster_2p2d
    payloads = [body(f"j{i}=5;" * 10, 400, False) for i in range(8)]
    o, killed, back = _kill_during(c, "decode", payloads, ready="answering")
    leaked = leaked_pages(c)
    record(Row("SIGKILL decode mid-answer (JSON)", "2P2D", o, leaked, back - killed))
    _check(o, leaked)
    assert o.ok == len(payloads) and o.error == 0, o
    _served_by(c, "decode-0")


def test_abort_storm(cluster_2p2d: Cluster, record: Callable[[Row], None]) -> None:
    """500 requests whose clients leave at random moments (before, during and after prefill)."""
    c = cluster_2p2d
    rng = random.Random(9)
    out = Outcomes()

    async def storm() -> None:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=c.url, timeout=30, limits=limits) as client:
            async def one(i: int) -> None:
                payload = body(f"s{i}=5;" * rng.randint(2, 40), 64, i % 2 == 0)
                try:
                    async with asyncio.timeout(rng.uniform(0.02, 1.5)):
                        r = await client.post("/v1/completions", json=payload)
                    out.ok += r.status_code == 200
                    out.error += r.status_code != 200
                except TimeoutError:
                    # the client left: the gateway must abort the request on both legs
                    out.aborted += 1
            await asyncio.gather(*(one(i) for i in range(500)))

    t0 = time.monotonic()
    asyncio.run(storm())
    leaked = leaked_pages(c, timeout_s=60)
    drained_s = time.monotonic() - t0
    record(Row("abort storm (500 clients leave)", "2P2D", out, leaked, None))
    assert out.ok + out.error + out.aborted == 500 and out.aborted > 100
    assert leaked == 0, f"{leaked} pages leaked after the storm"
    # The cluster still serves normally afterwards.
    r = httpx.post(f"{c.url}/v1/completions", json=body("c=3;\nc?", 4, False), timeout=60)
    assert r.status_code == 200, r.text
    assert drained_s < 120


@pytest.mark.parametrize("faults,overrides,n", [
    ("fail=0.05", (), 60),
    ("delay_ms=2500", (), 8),  # every write outlives transfer_timeout_s=2
], ids=["fail5pct", "delay-beyond-deadline"])
def test_transfer_faults(faults: str, overrides: tuple[str, ...], n: int, tmp_path: Path,
                         record: Callable[[Row], None]) -> None:
    with running_cluster(
        "configs/tiny-1p1d.yaml",
        *DEADLINES,
        *overrides,
        tmp=tmp_path,
        model=MODEL,
        env={"TANDEM_TRANSFER_FAULTS": faults},
    ) as c:
        payloads = [body(f"f{i}=6;" * 20, 6, i % 2 == 0) for i in range(n)]
        o = _run(c.url, payloads, 8, [0.0])
        leaked = leaked_pages(c)
        record(Row(f"TANDEM_TRANSFER_FAULTS={faults}", "1P1D", o, leaked, None))
        assert o.hung == 0 and o.ok + o.error == n
        assert leaked == 0, f"{leaked} pages leaked"
        if faults.startswith("fail"):
            assert o.ok > 0, "a 5% fault rate failed every request"
        else:
            assert o.error == n, "a write slower than the deadline succeeded"
            assert o.max_error_s < 4 * ERROR_WITHIN_S, f"a client waited {o.max_error_s:.1f}s"
