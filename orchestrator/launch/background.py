"""A whole cluster in the background: `tandem serve` as a user runs it, on free ports.

`running_cluster(config, *overrides, tmp=DIR)` starts the real launcher as a subprocess (real
workers, real gateway, real transfer backend) with a free gateway port (the launcher picks the
workers' ports itself), waits for the gateway's /health, and stops it with SIGTERM on exit.
Its run directory is `DIR/logs/<gateway port>/`. End-to-end tests and the serving benchmarks
(bench/) use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orchestrator.config import load_config
from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.tls import TLSConfig, channel

REPO = Path(__file__).resolve().parents[2]  # the checkout: configs/ and models/ live here
EMBEDDED_MODEL = REPO / "models" / "tandem-arith"


class ClusterStartError(AssertionError):
    """The cluster exited or was not ready in time; the message holds `tandem serve`'s output.
    (An AssertionError: tests that start clusters fail on it as on any assertion.)"""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output

    def first_error(self) -> str:
        """serve's own `error: ...` line (its one-line refusal), else the message's first."""
        lines = [ln for ln in self.output.splitlines() if ln.startswith("error: ")]
        return (lines[0] if lines else str(self).splitlines()[0]).removeprefix("error: ")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (the OS picks them)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class Cluster:
    url: str
    log_dir: Path
    workers: dict[str, str]  # name (prefill-0, decode-0, both-0) -> host:port
    proc: subprocess.Popen[bytes]
    tls: TLSConfig = field(default_factory=TLSConfig)  # how to dial the workers (the cluster's tls)
    admin_key: str = ""  # sent to the admin routes (/workers) when the cluster has one

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def list_workers(self) -> list[dict[str, object]]:
        """GET /workers (with the admin key)."""
        resp = httpx.get(f"{self.url}/workers", headers=self.admin_headers, timeout=5)
        resp.raise_for_status()
        return list(resp.json())

    def load(self, name: str) -> tandem_pb2.Load:
        with channel(self.workers[name], self.tls) as ch:
            return tandem_pb2_grpc.WorkerStub(ch).GetLoad(tandem_pb2.GetLoadRequest(), timeout=5)

    def wait_drained(self, timeout_s: float = 20.0) -> dict[str, tandem_pb2.Load]:
        """Every worker reports no used pages, no live rooms, nothing running or waiting, and the
        gateway counts no request in flight to any of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            loads = {name: self.load(name) for name in self.workers}
            busy: dict[str, object] = {
                n: ld
                for n, ld in loads.items()
                if ld.kv_used_pages
                or ld.kv_window_used_pages
                or ld.running
                or ld.waiting
                or any(ld.rooms.values())
            }
            busy.update(
                {
                    f"gateway -> {w['url']}": f"{w['inflight']} in flight"
                    for w in self.list_workers()
                    if w.get("inflight")
                }
            )
            if not busy:
                return loads
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not drained after {timeout_s}s: {busy}")
            time.sleep(0.05)

    def pid(self, role: str, replica: int) -> int:
        """The pid of one worker process of this cluster (its command line names the run's
        config)."""
        config = self.log_dir / "cluster.yaml"
        out = subprocess.run(
            ["pgrep", "-f", f"{config} --role {role} --replica {replica}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert len(out) == 1, f"expected one {role}-{replica} process, found {out}"
        return int(out[0])

    def healthy(self, url: str) -> bool:
        """Whether the gateway currently routes to the worker at `url`."""
        return any(w["url"] == url and w["healthy"] for w in self.list_workers())

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


@contextlib.contextmanager
def running_cluster(
    config: str,
    *overrides: str,
    tmp: Path,
    model: Path = EMBEDDED_MODEL,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 180.0,
    tls: TLSConfig | None = None,
    admin_key: str = "",
    logs: Path | None = None,
    port: int = 0,
) -> Iterator[Cluster]:
    """`tls`: serve every gRPC link with it (and dial the workers with it). `admin_key`: the
    gateway's (`--admin-key`), also sent by the Cluster's own calls to /workers. `logs`: the
    launcher's log_dir (default DIR/logs); two clusters may share one. `port`: the gateway's
    (0: a free one); `overrides` must not set another. ClusterStartError when it does not
    come up."""
    tls = tls or TLSConfig()
    load_config(_config_path(config))  # a bad config fails here, not after a launch
    gw = port or free_ports(1)[0]
    logs = logs or tmp / "logs"
    log_dir = logs / str(gw)
    sets = [
        f"gateway.port={gw}",
        f"launcher.log_dir={logs}",
        "launcher.ready_timeout_s=170",
        *overrides,
    ]
    if admin_key:
        sets.append(f"gateway.admin_key={admin_key}")
    if tls.enabled:
        sets += [
            f"tls.cert_file={tls.cert_file}",
            f"tls.key_file={tls.key_file}",
            f"tls.ca_file={tls.ca_file}",
        ]
    argv = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "serve",
        "--config",
        config,
        "--model",
        str(model),
    ]
    for s in sets:
        argv += ["--set", s]
    out = (tmp / "serve.out").open("wb")
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{gw}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                text = (tmp / "serve.out").read_text()
                raise ClusterStartError(f"cluster exited with {proc.returncode}:\n{text}", text)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                text = (tmp / "serve.out").read_text()
                raise ClusterStartError(f"cluster not ready in {ready_timeout_s}s:\n{text}", text)
            time.sleep(0.2)
        cluster = Cluster(
            url=url, log_dir=log_dir, workers={}, proc=proc, tls=tls, admin_key=admin_key
        )
        for w in cluster.list_workers():
            role = str(w["role"])
            # Named by the replica the worker reports (its process's --replica), not by the
            # order /workers lists them in: pid(role, replica) must name the same worker.
            replica = w.get("replica")
            index = replica if isinstance(replica, int) else sum(
                1 for n in cluster.workers if n.startswith(role))
            cluster.workers[f"{role}-{index}"] = str(w["url"])
        yield cluster
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.close()


def _config_path(config: str) -> Path:
    path = Path(config)
    return path if path.is_absolute() else REPO / path
