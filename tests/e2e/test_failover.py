"""Two decode workers: one dies mid-stream, its clients hear about it within seconds, the
gateway routes around it, and it rejoins once the launcher has restarted it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow


def stream(
    cluster: Cluster, results: list[tuple[str, float]], started: threading.Semaphore
) -> None:
    """One long streaming request: records how it ended ('done' or 'error') and when."""
    body = {
        "model": MODEL.name,
        "prompt": "k=42;" * 20,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    outcome = "done"
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        first = True
        for line in r.iter_lines():
            if first and '"text"' in line:
                started.release()
                first = False
            if '"error"' in line:
                outcome = "error"
    results.append((outcome, time.monotonic()))


def test_decode_death_mid_stream_and_rejoin(tmp_path: Path) -> None:
    overrides = (
        "launcher.on_worker_exit=restart",
        "launcher.max_restarts=1",
        "gateway.health_interval_s=0.5",
    )
    with running_cluster("configs/tiny-2p2d.yaml", *overrides, tmp=tmp_path, model=MODEL) as c:
        dead_url = c.workers["decode-0"]
        results: list[tuple[str, float]] = []
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=stream, args=(c, results, started)) for _ in range(6)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60), "streams did not start"
        assert c.load("decode-0").running > 0, (
            "least_load should have spread streams over both decoders"
        )
        killed_at = time.monotonic()
        os.kill(c.pid("decode", 0), signal.SIGKILL)

        # The gateway notices and stops routing there; new requests succeed meanwhile.
        deadline = time.monotonic() + 10
        while c.healthy(dead_url):
            assert time.monotonic() < deadline, "dead decode worker still marked healthy"
            time.sleep(0.05)
        for _ in range(4):
            r = httpx.post(
                f"{c.url}/v1/completions",
                json={"model": MODEL.name, "prompt": "a=1;\na?", "max_tokens": 3},
                timeout=60,
            )
            assert r.status_code == 200, r.text

        for t in threads:
            t.join(timeout=90)
        errors = [at - killed_at for outcome, at in results if outcome == "error"]
        assert len(results) == 6 and errors, (
            f"no stream on the killed worker reported an error: {results}"
        )
        assert max(errors) < 5.0, (
            f"clients of the dead worker waited {max(errors):.1f}s for their error"
        )

        # The launcher restarts it on the same port; the gateway takes it back.
        deadline = time.monotonic() + 120
        while not c.healthy(dead_url):
            assert time.monotonic() < deadline, "restarted decode worker never rejoined"
            time.sleep(0.2)
        before = c.load("decode-0").transfer_pages
        deadline = time.monotonic() + 60
        while (
            c.load("decode-0").transfer_pages == before
        ):  # concurrent bursts: least_load spreads them
            assert time.monotonic() < deadline, "the rejoined worker took no requests"
            burst = [
                threading.Thread(
                    target=lambda: httpx.post(
                        f"{c.url}/v1/completions",
                        json={
                            "model": MODEL.name,
                            "prompt": "b=2;\nb?",
                            "max_tokens": 20,
                            "ignore_eos": True,
                        },
                        timeout=60,
                    ).raise_for_status()
                )
                for _ in range(6)
            ]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
        c.wait_drained()
