"""The local launcher's start-up contracts: ports checked and chosen before anything starts, a
run directory per cluster, identity-checked readiness, and workers that drain and leave.

Real child processes (tests/orchestrator/proc_double.py serves grpc health and GetInfo like a
worker) and real sockets; nothing here loads a model.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import config_from_dict
from orchestrator.launch.local import run_dir_of
from orchestrator.launch.ports import PortInUseError, check_ports, is_free, resolve_ports
from orchestrator.launch.processes import LaunchError, LocalCluster, ProcessSpec
from orchestrator.launch.run_dir import RunDir
from protocol.identity import WorkerIdentity
from tests.orchestrator.test_launch_local import DOUBLE, free_port, grpc_worker, http_gateway

EXPECTED = WorkerIdentity(cluster_id="c-new", role="decode", replica=0, model_fingerprint="m:1111")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on (another cluster's process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def stale_worker(tmp: Path, port: int, cluster_id: str, model: str) -> subprocess.Popen[bytes]:
    """A worker of another cluster (or model) that answers SERVING on `port`."""
    log = (tmp / f"stale-{port}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            DOUBLE,
            "grpc",
            "--port",
            str(port),
            "--cluster-id",
            cluster_id,
            "--role",
            "decode",
            "--model",
            model,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while is_free("127.0.0.1", port):
        assert proc.poll() is None and time.monotonic() < deadline, "stale double did not start"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize(
    ("cluster_id", "model", "found"),
    [
        ("c-old", "m:1111", "found cluster c-old role decode replica 0 model m:1111"),
        ("c-new", "m:2222", "found cluster c-new role decode replica 0 model m:2222"),
    ],
)
def test_stale_worker_on_an_expected_address_is_refused_at_start(
    tmp_path: Path, cluster_id: str, model: str, found: str
) -> None:
    port = free_port()
    stale = stale_worker(tmp_path, port, cluster_id, model)
    try:
        # Our own worker is still loading (it never listens); the stale one answers SERVING.
        ours = ProcessSpec(
            "decode-0",
            [sys.executable, "-c", "import time; time.sleep(60)"],
            tmp_path / "decode-0.log",
            grpc_address=f"127.0.0.1:{port}",
            identity=EXPECTED,
        )
        lc = LocalCluster(
            [ours], http_gateway(tmp_path), ready_timeout_s=20, stop_grace_s=5, err=io.StringIO()
        )
        with pytest.raises(LaunchError) as info:
            lc.start()
        line = str(info.value)
        assert "\n" not in line
        assert line == (
            f"refusing the worker at 127.0.0.1:{port}: expected cluster c-new role decode "
            f"replica 0 model m:1111, {found} (a worker of another cluster or model "
            "answers there)"
        )
        assert all(c.proc.poll() is not None for c in lc.children()), "everything is stopped"
        assert not (tmp_path / "lb.log").exists(), "the gateway never starts beside a stranger"
    finally:
        stale.terminate()
        stale.wait(timeout=10)


def test_the_expected_worker_is_accepted(tmp_path: Path) -> None:
    w = grpc_worker(tmp_path, "decode-0")
    w.argv.extend(["--cluster-id", "c-new", "--role", "decode", "--model", "m:1111"])
    spec = ProcessSpec(w.name, w.argv, w.log_path, grpc_address=w.grpc_address, identity=EXPECTED)
    lc = LocalCluster(
        [spec], http_gateway(tmp_path), ready_timeout_s=30, stop_grace_s=5, err=io.StringIO()
    )
    lc.start()
    assert lc.dead_child() is None
    assert [s.split(" (")[0] for s in lc.stop()] == ["lb", "decode-0"]  # what it stopped, in order


def test_a_worker_that_drains_and_exits_0_leaves_the_cluster_serving(tmp_path: Path) -> None:
    err = io.StringIO()
    leaving = grpc_worker(tmp_path, "decode-1", exit_after=1.5)
    leaving.argv.extend(["--exit-code", "0"])
    lc = LocalCluster(
        [grpc_worker(tmp_path, "decode-0"), leaving],
        http_gateway(tmp_path),
        ready_timeout_s=30,
        stop_grace_s=5,
        err=err,
    )
    lc.start()
    threading.Timer(4.0, lc.request_stop).start()
    t0 = time.monotonic()
    assert lc.watch() is None, "a drained worker must not end the cluster"
    assert time.monotonic() - t0 > 3.0
    assert (
        "decode-1 drained and left the cluster (exit 0); serving on with 1 launched worker\n"
        in err.getvalue()
    )
    lc.stop()
    assert all(c.proc.poll() is not None for c in lc.children())


def pd_config(tmp: Path, **launcher: object) -> dict[str, object]:
    return {
        "roles": {"prefill": {"count": 2}, "decode": {"count": 2}},
        "launcher": {"log_dir": str(tmp), **launcher},
    }


def test_busy_pinned_ports_are_refused_naming_port_process_and_key(
    tmp_path: Path, busy_port: int
) -> None:
    gw_busy = config_from_dict({**pd_config(tmp_path), "gateway": {"port": busy_port}})
    with pytest.raises(
        PortInUseError,
        match=rf"^port {busy_port} \(gateway, gateway.port \(or "
        rf"--port\)\) is in use on 127.0.0.1",
    ):
        check_ports(resolve_ports(gw_busy))
    # the gateway on a free port: 8000 may be a developer's own cluster, checked first
    data = {**pd_config(tmp_path), "gateway": {"port": free_port()}}
    busy_decode = {**data, "roles": {"prefill": {"count": 2},
                                     "decode": {"count": 2, "base_port": busy_port - 10}}}
    with pytest.raises(
        PortInUseError,
        match=rf"^port {busy_port} \(decode-1, "
        r"roles.decode.base_port\) is in use",
    ):
        check_ports(resolve_ports(config_from_dict(busy_decode)))
    # A pinned bootstrap port: the second prefill replica would bind the same one.
    pinned = config_from_dict({**data, "transfer": {"bootstrap_port": free_port()}})
    with pytest.raises(
        PortInUseError,
        match=r"prefill-1 bootstrap \(rank 0\) and prefill-0 "
        r"bootstrap \(rank 0\) would both listen",
    ):
        check_ports(resolve_ports(pinned))


def test_unpinned_ports_are_chosen_free_and_a_second_cluster_gets_others(tmp_path: Path) -> None:
    first = resolve_ports(config_from_dict(pd_config(tmp_path)))
    ports = [rc.port(i) for _, rc in first.roles.present() for i in range(rc.count)]
    assert len(set(ports)) == 4 and all(20000 <= p < 32000 for p in ports)
    held = []
    try:
        for p in ports:  # the first cluster's workers listen there now
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            s.listen()
            held.append(s)
        second = resolve_ports(config_from_dict({**pd_config(tmp_path), "gateway": {"port": 8005}}))
        others = [rc.port(i) for _, rc in second.roles.present() for i in range(rc.count)]
        assert not set(others) & set(ports)
    finally:
        for s in held:
            s.close()
    pinned = config_from_dict({"roles": {"both": {"base_port": 40000}}})
    assert resolve_ports(pinned).roles.both.port(0) == 40000  # type: ignore[union-attr]


def test_each_cluster_has_its_own_run_directory_not_appended_across_runs(tmp_path: Path) -> None:
    a = config_from_dict(pd_config(tmp_path))
    b = config_from_dict({**pd_config(tmp_path), "gateway": {"port": 8005}})
    assert run_dir_of(a) == tmp_path / "8000" and run_dir_of(b) == tmp_path / "8005"
    with RunDir(run_dir_of(a)) as run:
        (run / "lb.log").write_text("first run\n")
    with RunDir(run_dir_of(a)) as again:
        assert list(again.iterdir()) == [], "a new run starts with empty logs"
    assert (tmp_path / "8000.prev" / "lb.log").read_text() == "first run\n"  # one run kept
    pinned = config_from_dict({**pd_config(tmp_path, run_dir=str(tmp_path / "r"))})
    assert run_dir_of(pinned) == tmp_path / "r"


def test_serve_refuses_a_busy_gateway_port_in_one_line_before_starting_anything(
    tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["serve", "--port", str(busy_port), "--set", f"launcher.log_dir={tmp_path / 'logs'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (
        f"error: port {busy_port} (gateway, gateway.port (or --port)) is in use "
        "on 127.0.0.1: another cluster? change gateway.port (or --port)"
    )
    assert "ready:" not in err and not (tmp_path / "logs").exists()
