"""The pools at run time, under steady load on configs/tiny-2p2d.yaml.

A third decode worker joins (`tandem worker --join`), one decode worker is removed
(DELETE /workers: drained, then gone), and every worker is replaced in turn, one at a time (a
rolling restart: a fresh worker joins, then the old one is deleted). Through all of it: zero
failed requests, every removed worker drained with every page free, and at the end no used
page, no live room, nothing in flight anywhere. Prints the figures docs/reliability.md quotes
(failed requests, time from DELETE to a drained and exited worker, requests in flight then).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, REPO, Cluster, running_cluster
from protocol import tandem_pb2, tandem_pb2_grpc

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
ADMIN_KEY = "admin-test-key"
CONCURRENCY = 3
pytestmark = pytest.mark.slow


@dataclass
class Load:
    """Closed-loop load: CONCURRENCY clients, each sending the next request when one ends."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    async def _client(self, i: int, client: httpx.AsyncClient) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (i + n) % 2 == 0
            body = {
                "model": MODEL.name,
                "prompt": f"k={10 + n % 80};b={i}{n % 10};\nk?",
                "max_tokens": 16,
                "ignore_eos": True,
                "stream": stream,
            }
            try:
                r = await client.post("/v1/completions", json=body)
                text = r.text
            except httpx.HTTPError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                continue
            finished = '"finish_reason":"length"' in text.replace(" ", "")
            if r.status_code != 200 or '"error"' in text or not finished:
                self.failures.append(f"HTTP {r.status_code}: {text[:300]}")
            else:
                self.ok += 1

    def _run(self) -> None:
        async def main() -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
                await asyncio.gather(*(self._client(i, client) for i in range(CONCURRENCY)))

        asyncio.run(main())

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=120)


@dataclass
class Joined:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def wait_for(what: str, check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def join(c: Cluster, role: str, tmp: Path, name: str, port: int = 0) -> Joined:
    """A fresh worker of `role` joins the running gateway (its run's cluster.yaml, a free port,
    or `port`: then its url may be listed already, as a dead worker's)."""
    before = {w["url"] for w in c.list_workers()} if not port else set()
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "worker",
                "--config",
                str(c.log_dir / "cluster.yaml"),
                "--role",
                role,
                "--join",
                c.url,
                *(["--port", str(port)] if port else []),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def serving() -> str:
        assert proc.poll() is None, log.read_text()
        at = f":{port}" if port else ""
        new = [
            w
            for w in c.list_workers()
            if w["url"] not in before and w["role"] == role and str(w["url"]).endswith(at)
        ]
        return str(new[0]["url"]) if new and new[0]["state"] == "serving" else ""

    return Joined(proc, wait_for(f"{name} to join", serving), log)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or being reaped as we read (ESRCH)
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def remove(c: Cluster, url: str, pid: int) -> tuple[float, int]:
    """DELETE the worker; (seconds until its process exited, requests in flight at DELETE)."""
    t0 = time.monotonic()
    r = httpx.delete(f"{c.url}/workers/{url}", headers=c.admin_headers, timeout=10)
    assert r.status_code == 202, r.text
    inflight = int(r.json()["inflight"]) + int(r.json()["running"])
    wait_for(f"{url} to exit", lambda: not alive(pid), timeout_s=60)
    exited = time.monotonic() - t0
    wait_for(f"{url} to leave /workers", lambda: url not in {w["url"] for w in c.list_workers()})
    return exited, inflight


def load_of(url: str) -> tandem_pb2.Load:
    with grpc.insecure_channel(url) as ch:
        return tandem_pb2_grpc.WorkerStub(ch).GetLoad(tandem_pb2.GetLoadRequest(), timeout=5)


def held(c: Cluster) -> dict[str, str]:
    """What any worker (or the gateway) still holds; empty when everything is free."""
    out = {}
    for w in c.list_workers():
        ld = load_of(str(w["url"]))
        if ld.kv_used_pages or ld.running or ld.waiting or any(ld.rooms.values()) or w["inflight"]:
            out[str(w["url"])] = (
                f"{ld.kv_used_pages} pages, rooms {dict(ld.rooms)}, {w['inflight']} in flight"
            )
    return out


def test_join_remove_and_rolling_restart_under_load_fail_nothing(tmp_path: Path) -> None:
    with running_cluster(
        "configs/tiny-2p2d.yaml",
        "gateway.health_interval_s=0.5",
        tmp=tmp_path,
        model=MODEL,
        admin_key=ADMIN_KEY,
    ) as c:
        launched = {
            name: (url, c.pid(name.split("-")[0], int(name.split("-")[1])))
            for name, url in c.workers.items()
        }
        joined: list[Joined] = []
        load = Load(c.url).start()
        removals: list[tuple[str, float, int]] = []
        try:
            # 1. A third decode worker joins and takes requests.
            extra = join(c, "decode", tmp_path, "decode-joined")
            joined.append(extra)
            wait_for(
                "the joined decode worker to take requests",
                lambda: load_of(extra.url).transfer_pages > 0,
            )
            # 2. One decode worker is removed: drained, exited, gone.
            url, pid = launched.pop("decode-0")
            removals.append(("decode-0", *remove(c, url, pid)))
            # 3. Rolling restart: every worker in turn, a fresh one first.
            for name, (url, pid) in sorted(launched.items()):
                joined.append(join(c, name.split("-")[0], tmp_path, f"{name}-new"))
                removals.append((name, *remove(c, url, pid)))
            old = joined.pop(0)  # the third decode worker is a worker too
            joined.append(join(c, "decode", tmp_path, "decode-joined-new"))
            removals.append(("decode-joined", *remove(c, old.url, old.proc.pid)))
            old.proc.wait(timeout=10)
        finally:
            load.stop()
        try:
            assert not load.failures, (
                f"{len(load.failures)} failed of {load.ok + len(load.failures)}: "
                f"{load.failures[:3]}"
            )
            assert load.ok > 50, f"too little load to prove anything ({load.ok} requests)"
            wait_for(
                "every page free, no room, nothing in flight", lambda: not held(c), timeout_s=30
            )
            for name in ("decode-0", "decode-1", "prefill-0", "prefill-1"):
                assert "drained in" in c.log(name) and "every page free" in c.log(name), name
            assert "every page free" in old.log.read_text()
            roles = sorted(str(w["role"]) for w in c.list_workers())
            assert roles == ["decode", "decode", "prefill", "prefill"]
            assert all(w["source"] == "joined" for w in c.list_workers())
        finally:
            for j in joined:
                j.proc.send_signal(signal.SIGTERM)  # drains, leaves the gateway, exits
            for j in joined:
                j.proc.wait(timeout=60)
        times = [t for _, t, _ in removals]
        print(
            f"\nmembership under load (tiny-2p2d, {CONCURRENCY} clients): {load.ok} requests, "
            f"{len(load.failures)} failed; {len(removals)} workers removed; DELETE -> drained and "
            f"exited: median {statistics.median(times):.2f} s, max {max(times):.2f} s; in flight "
            f"at DELETE: {[n for _, _, n in removals]}"
        )
        for name, t, n in removals:
            print(f"  {name}: {t:.2f} s, {n} in flight")


def test_a_joined_worker_started_again_on_its_port_after_a_crash_joins_again(
    tmp_path: Path,
) -> None:
    # A supervisor restarts a crashed `tandem worker --join --port N`: the gateway still lists
    # its dead entry. Before, its POST was a 409 (already in the pool) and the new worker
    # stopped itself with exit 1, every time, leaving the pool a worker short.
    with running_cluster(
        "configs/tiny-1p1d.yaml",
        "gateway.health_interval_s=0.5",
        tmp=tmp_path,
        model=MODEL,
        admin_key=ADMIN_KEY,
    ) as c:
        first = join(c, "decode", tmp_path, "decode-joined")
        port = int(first.url.rpartition(":")[2])
        first.proc.kill()  # kill -9: no drain, no DELETE
        first.proc.wait(timeout=10)
        wait_for(
            "the killed worker to show dead",
            lambda: {w["url"]: w["state"] for w in c.list_workers()}.get(first.url) == "dead",
        )
        again = join(c, "decode", tmp_path, "decode-again", port=port)
        try:
            assert again.url == first.url
            log = again.log.read_text
            wait_for("its answer", lambda: "joined http" in log() or "error: --join" in log())
            assert "joined http" in log() and again.proc.poll() is None, log()[-600:]
            load = Load(c.url).start()
            try:
                wait_for("it to take requests", lambda: load_of(again.url).transfer_pages > 0)
            finally:
                load.stop()
            assert not load.failures, load.failures[:3]
            assert [w["url"] for w in c.list_workers()].count(again.url) == 1
        finally:
            again.proc.send_signal(signal.SIGTERM)
            again.proc.wait(timeout=60)
        assert "every page free" in again.log.read_text()


def test_a_joined_worker_is_listed_again_by_a_gateway_that_restarted(tmp_path: Path) -> None:
    # The gateway crashes and its launcher starts it again on its port: it serves the config's
    # workers only. A worker that joined renews its join (orchestrator/launch/join.py), so the
    # new gateway lists it again within the renewal period and routes to it.
    with running_cluster(
        "configs/tiny-1p1d.yaml",
        "gateway.health_interval_s=0.5",
        "launcher.on_worker_exit=restart",
        tmp=tmp_path,
        model=MODEL,
        admin_key=ADMIN_KEY,
    ) as c:
        joined = join(c, "decode", tmp_path, "decode-joined")
        try:
            gateway = subprocess.run(
                ["pgrep", "-f", f"orchestrator.cli gateway --config {c.log_dir / 'cluster.yaml'}"],
                capture_output=True, text=True, check=True,
            ).stdout.split()
            assert len(gateway) == 1, gateway
            os.kill(int(gateway[0]), signal.SIGKILL)
            wait_for("the gateway to go", lambda: not alive(int(gateway[0])))

            def listed() -> bool:
                try:
                    states = {w["url"]: w["state"] for w in c.list_workers()}
                except httpx.HTTPError:  # not answering yet
                    return False
                return states.get(joined.url) == "serving"

            t0 = time.monotonic()
            wait_for("the restarted gateway to list the joined worker", listed, timeout_s=60)
            print(f"\njoined worker listed again {time.monotonic() - t0:.1f} s after the kill")
            assert "joined again" in joined.log.read_text()
            before = load_of(joined.url).transfer_pages
            load = Load(c.url).start()
            try:
                wait_for("it to take requests", lambda: load_of(joined.url).transfer_pages > before)
            finally:
                load.stop()
            assert not load.failures, load.failures[:3]
        finally:
            joined.proc.send_signal(signal.SIGTERM)
            joined.proc.wait(timeout=60)
        assert "every page free" in joined.log.read_text()
