"""Two clusters in one checkout, as a user starts them: `tandem serve` twice, only --port changed.

Both serve correctly with their own workers (disjoint addresses, their own cluster ids) and
their own run directories; a second cluster that pins a port the first one holds is refused
before it says ready, naming the port; no listener of either binds an address the config did
not name (Mooncake's and NIXL's included); and a stranger that appears on a cluster's worker
address after its worker left (another cluster id) is refused on reconnect, never routed to.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from orchestrator.eval import run_eval
from orchestrator.launch.background import (
    EMBEDDED_MODEL,
    REPO,
    Cluster,
    free_ports,
    running_cluster,
)
from orchestrator.launch.ports import is_free
from orchestrator.tasks import get_task
from tests.listeners import descendants, listeners

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    logs = tmp_path_factory.mktemp("checkout") / "logs"  # one log_dir, as in one checkout
    with ExitStack() as stack:
        a, b = (
            stack.enter_context(
                running_cluster(
                    "configs/tiny-1p1d.yaml", logs=logs, model=MODEL, tmp=tmp_path_factory.mktemp(n)
                )
            )
            for n in ("a", "b")
        )
        yield a, b


def cluster_id(c: Cluster) -> str:
    return str(yaml.safe_load((c.log_dir / "cluster.yaml").read_text())["launcher"]["cluster_id"])


def accuracy(c: Cluster, samples: int = 16) -> float:
    result = asyncio.run(run_eval(c.url, get_task("arith"), samples, 4, 7, "", ""))
    assert result.failed == 0, result.errors
    return result.accuracy


def test_both_serve_correctly_with_disjoint_workers_and_separate_logs(
    two_clusters: tuple[Cluster, Cluster],
) -> None:
    a, b = two_clusters
    assert accuracy(a) >= 0.8 and accuracy(b) >= 0.8
    ids = {cluster_id(a), cluster_id(b)}
    assert len(ids) == 2
    for c in (a, b):
        ws = c.list_workers()
        assert {w["role"] for w in ws} == {"prefill", "decode"}
        assert all(w["cluster_id"] == cluster_id(c) and w["state"] == "serving" for w in ws), ws
    assert not {w["url"] for w in a.list_workers()} & {w["url"] for w in b.list_workers()}
    assert a.log_dir != b.log_dir and a.log_dir.parent == b.log_dir.parent
    for c, other in ((a, b), (b, a)):
        names = {p.name for p in c.log_dir.iterdir()}
        assert {"cluster.yaml", "prefill-0.log", "decode-0.log", "lb.log"} <= names
        text = c.log("decode-0")
        assert f"cluster {cluster_id(c)}" in text and cluster_id(other) not in text
    assert not any(p.is_file() for p in a.log_dir.parent.iterdir()), "no file shared at the root"


def test_a_pinned_port_the_other_cluster_holds_is_refused_before_ready(
    two_clusters: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    a, _ = two_clusters
    taken = int(a.workers["prefill-0"].rsplit(":", 1)[1])
    (gw,) = free_ports(1)
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "serve",
            "--port",
            str(gw),
            "--model",
            str(MODEL),
            "--set",
            f"roles.prefill.base_port={taken}",
            "--set",
            f"launcher.log_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2 and "ready:" not in out.stdout, out.stdout + out.stderr
    assert out.stderr.strip() == (
        f"error: port {taken} (prefill-0, roles.prefill.base_port) is in "
        "use on 127.0.0.1: another cluster? change roles.prefill.base_port"
    )
    assert time.monotonic() - t0 < 30 and not any(tmp_path.iterdir()), "nothing was started"


def assert_listens_only_on_loopback(c: Cluster) -> None:
    found = listeners(descendants(c.proc.pid))
    kinds = {
        ln.command.split(" --role ")[1].split()[0] if " --role " in ln.command else "other"
        for ln in found
    }
    assert {"prefill", "decode"} <= kinds, found
    wrong = [str(ln) for ln in found if ln.address != "127.0.0.1"]
    assert not wrong, f"listeners on addresses the config did not name: {wrong}"
    # Mooncake's handshake and data ports are among them (the bind-host shim is loaded).
    assert any(15000 <= ln.port <= 17000 for ln in found), found


def test_no_listener_binds_an_address_the_config_did_not_name(
    two_clusters: tuple[Cluster, Cluster],
) -> None:
    for c in two_clusters:
        assert_listens_only_on_loopback(c)


def test_nixl_listeners_bind_only_the_configured_host(tmp_path: Path) -> None:
    with running_cluster(
        "configs/tiny-1p1d.yaml", "transfer.backend=nixl", tmp=tmp_path, model=MODEL
    ) as c:
        r = httpx.post(
            f"{c.url}/v1/completions",
            json={"model": MODEL.name, "prompt": "a=1;\na?", "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        found = listeners(descendants(c.proc.pid))
        wrong = [str(ln) for ln in found if ln.address != "127.0.0.1"]
        assert not wrong, f"listeners on addresses the config did not name: {wrong}"


def test_join_refused_by_the_gateway_exits_1_with_the_reason(
    two_clusters: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    a, _ = two_clusters  # started without --admin-key: the pools cannot be changed
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--config",
            str(a.log_dir / "cluster.yaml"),
            "--role",
            "decode",
            "--join",
            a.url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-2000:]  # one line, the gateway's reason in it
    assert errors[0].startswith(f"error: --join: {a.url} refused 127.0.0.1:")
    assert errors[0].endswith(
        ": HTTP 403: admin routes are off: start the gateway with --admin-key KEY "
        "(gateway.admin_key) and send `Authorization: Bearer KEY`"
    )
    assert "DELETE" not in out.stderr, out.stderr[-2000:]  # never joined: nothing to leave
    assert {w["url"] for w in a.list_workers()} == set(a.workers.values())


def test_a_stranger_on_a_workers_address_is_refused_on_reconnect(
    two_clusters: tuple[Cluster, Cluster], tmp_path: Path
) -> None:
    """Destructive (A loses its decode worker): the module's last test."""
    a, _ = two_clusters
    url = a.workers["decode-0"]
    os.kill(a.pid("decode", 0), signal.SIGTERM)  # drains, exits 0: it leaves the cluster
    deadline = time.monotonic() + 30
    while not is_free("127.0.0.1", int(url.rsplit(":", 1)[1])):
        assert time.monotonic() < deadline, "decode-0 did not exit after SIGTERM"
        time.sleep(0.1)
    log = (tmp_path / "stranger.log").open("wb")
    stranger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--config",
            str(a.log_dir / "cluster.yaml"),
            "--role",
            "decode",
            "--replica",
            "0",
            "--set",
            "launcher.cluster_id=another",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            w = next(x for x in a.list_workers() if x["url"] == url)
            if w["state"] == "refused":
                break
            assert stranger.poll() is None and time.monotonic() < deadline, w
            time.sleep(0.1)
        line = (
            f"refusing the worker at {url}: expected cluster {cluster_id(a)} role decode model "
            f"{MODEL.name}:"
        )
        assert w["error"].startswith(line) and "found cluster another role decode" in w["error"]
        assert w["error"] in a.log("lb"), "the gateway logs the one-line refusal"
        for _ in range(3):
            r = httpx.post(
                f"{a.url}/v1/completions",
                json={"model": MODEL.name, "prompt": "a=1;\na?", "max_tokens": 3},
                timeout=30,
            )
            assert r.status_code == 503, r.text  # no decode worker of its own is left
        assert a.load("decode-0").transfer_pages == 0 and a.load("decode-0").running == 0
    finally:
        stranger.send_signal(signal.SIGTERM)
        stranger.wait(timeout=30)
        log.close()
