"""Partial failure without collateral damage (issue 22), on real clusters: one frozen decode
worker, KV writes failing at random, more streams than decode seats, idle sockets.

Every drill ends with no page held anywhere. The figures (before/after) are in
docs/reliability.md; `python -m bench.reliability` runs the same probes at full size.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import Cluster, running_cluster
from tests.e2e.chaos.conftest import MODEL, leaked_pages
from tests.e2e.chaos.probes import (
    client,
    faults_probe,
    freeze_probe,
    metric,
    overload_probe,
    payload,
    sockets_probe,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TRANSFER_S, BOOTSTRAP_S, STALL_S, HEADER_S = 2.0, 3.0, 3.0, 2.0
DEADLINES = (f"transfer.bootstrap_timeout_s={BOOTSTRAP_S}", "transfer.waiting_timeout_s=10",
             f"transfer.transfer_timeout_s={TRANSFER_S}", "gateway.health_interval_s=0.3",
             f"gateway.stream_stall_timeout_s={STALL_S}")


@pytest.fixture(scope="module")
def cluster_2p2d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster("configs/tiny-2p2d.yaml", *DEADLINES,
                         tmp=tmp_path_factory.mktemp("freeze2p2d"), model=MODEL) as c:
        yield c


def test_frozen_decode_worker_does_not_stall_the_cluster(cluster_2p2d: Cluster) -> None:
    """SIGSTOP decode-0 for longer than the transfer deadline under steady load."""
    c = cluster_2p2d
    f = asyncio.run(freeze_probe(c, MODEL.name, baseline_s=8.0, freeze_s=5 * TRANSFER_S,
                                 after_s=4.0, clients=12, streams=6))
    assert f.hung == 0 and f.empty_200 == 0
    assert f.rps_during >= 0.5 * f.rps_before, (f.rps_before, f.rps_during)
    # A room bound for the frozen worker fails within its deadline (+1 s) and is retried on
    # the other decode worker (+4 s for the retry on a loaded box: 6.3 s and 7.08 s were seen
    # with the suite's cluster modules running beside it), so no short request that overlapped
    # the freeze waited it out: that takes the whole freeze, 10 s.
    assert f.slowest_ok_s < BOOTSTRAP_S + 1.0 + 4.0 < 5 * TRANSFER_S, f.slowest_ok_s
    # Streams that were mid-answer on it end with an error within the stall deadline.
    assert f.stall_resumed == 0 and f.stall_error_s < STALL_S + 1.5, (f.stalled_streams,
                                                                      f.stall_error_s)
    assert f.rejoin_s < 30, "decode-0 never rejoined after SIGCONT"
    frozen = c.workers["decode-0"]
    assert metric(c.url, "tandem_worker_faults_total", f'worker="{frozen}"') > 0
    for name in ("decode-1", "prefill-0", "prefill-1"):  # no bystander is blamed
        assert metric(c.url, "tandem_worker_faults_total", f'worker="{c.workers[name]}"') == 0
    log = c.log("prefill-0") + c.log("prefill-1")
    assert "fenced" not in log or "answers again" in log  # a fence, if any, lifted after SIGCONT
    _rejoined(c, "decode-0")
    assert leaked_pages(c) == 0


def test_stream_on_a_frozen_decode_errors_within_the_stall_deadline(cluster_2p2d: Cluster) -> None:
    """A stream that has had tokens; the decode worker running it is SIGSTOPped: the stream
    ends with an error event within the stall deadline."""
    c = cluster_2p2d
    body = payload("k=3;" * 20, 300, True, MODEL.name)

    async def one() -> tuple[float, int, str]:
        tokens, victim, t0 = 0, "", 0.0
        async with client(c.url, 2) as cl, cl.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if '"error"' in line:
                    return time.monotonic() - t0, tokens, line
                tokens += 1
                if tokens == 3:  # mid-answer: freeze the decode worker running it
                    victim = await asyncio.to_thread(_decode_running_one, c)
                    os.kill(c.pid("decode", int(victim[-1])), signal.SIGSTOP)
                    t0 = time.monotonic()
        return float("inf"), tokens, "the stream ended without an error"

    try:
        took, tokens, last = asyncio.run(one())
    finally:
        for i in (0, 1):
            os.kill(c.pid("decode", i), signal.SIGCONT)
    assert "stream_stall_timeout_s" in last, last
    assert took < STALL_S + 1.5, f"the stalled stream erred after {took:.1f}s"
    _rejoined(c, "decode-0")
    _rejoined(c, "decode-1")
    assert leaked_pages(c) == 0


def _decode_running_one(c: Cluster) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for name in ("decode-0", "decode-1"):
            if c.load(name).running:
                return name
        time.sleep(0.02)
    raise AssertionError("the stream never ran on a decode worker")


def _rejoined(c: Cluster, name: str) -> None:
    deadline = time.monotonic() + 30
    while not c.healthy(c.workers[name]):
        assert time.monotonic() < deadline, f"{name} did not rejoin"
        time.sleep(0.1)


def test_failing_writes_never_give_an_empty_200(tmp_path: Path) -> None:
    """fail=0.3 on 2P2D, 300 requests: a full answer or an error status, never a 200 with
    finish_reason "abort"; the gateway's counters agree with what clients saw."""
    with running_cluster("configs/tiny-2p2d.yaml", *DEADLINES, tmp=tmp_path, model=MODEL,
                         env={"TANDEM_TRANSFER_FAULTS": "fail=0.3"}) as c:
        f = asyncio.run(faults_probe(c.url, MODEL.name, n=300))
        assert f.empty_200 == 0 and f.hung == 0
        assert f.ok + f.errors == 300 and f.ok >= 200, f
        assert f.metrics_success == f.ok and f.metrics_errors == f.errors, f
        assert leaked_pages(c) == 0


@pytest.fixture(scope="module")
def cluster_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster("configs/tiny-1p1d.yaml", f"gateway.header_timeout_s={HEADER_S}",
                         tmp=tmp_path_factory.mktemp("over1p1d"), model=MODEL) as c:
        yield c


def test_idle_and_half_header_sockets_are_closed(cluster_1p1d: Cluster) -> None:
    s = sockets_probe(cluster_1p1d.url, MODEL.name, idle=500, partial=500,
                      watch_s=HEADER_S + 10.0)
    assert s.closed_idle == 500 and s.closed_partial == 500 and s.got_408 == 500, s
    assert s.last_close_s < HEADER_S + 5.0, s
    assert s.normal_ok == s.normal_sent, s


def test_more_streams_than_seats_wait_before_their_first_token(cluster_1p1d: Cluster) -> None:
    """300 streams at once on 1P1D (32 decode seats): each waits for its seat before its first
    token, never between two tokens. Bound on a gap: 2.5 s on this shared 2-core box, where the
    first tokens wait ~5-9 s: 1.5 s read 1.60 s once in a full fresh-clone `make test`, the
    other xdist worker starting clusters beside it (p99 gap 0.09 s, no error)."""
    o = asyncio.run(overload_probe(cluster_1p1d.url, MODEL.name, n=300, max_tokens=64))
    assert o.ok == 300 and o.errors == 0, o
    assert o.max_gap_s < 2.5 and o.p99_gap_s < 0.5, o
    q = httpx.get(f"{cluster_1p1d.url}/metrics", timeout=10).text
    assert "tandem_queue_wait_seconds_count" in q
    assert leaked_pages(cluster_1p1d) == 0
