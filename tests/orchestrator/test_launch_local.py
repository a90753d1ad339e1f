"""The local launcher with real child processes (gRPC / HTTP health doubles from proc_double.py)."""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config import config_from_dict
from orchestrator.launch.local import cluster_specs, crash_text
from orchestrator.launch.processes import LaunchError, LocalCluster, ProcessSpec

DOUBLE = str(Path(__file__).with_name("proc_double.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def grpc_worker(
    tmp: Path, name: str, status: str = "SERVING", exit_after: float = 0.0
) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(
        name,
        [
            sys.executable,
            DOUBLE,
            "grpc",
            "--port",
            str(port),
            "--status",
            status,
            "--exit-after",
            str(exit_after),
        ],
        tmp / f"{name}.log",
        grpc_address=f"127.0.0.1:{port}",
    )


def http_gateway(tmp: Path) -> ProcessSpec:
    port = free_port()
    return ProcessSpec(
        "lb",
        [sys.executable, DOUBLE, "http", "--port", str(port)],
        tmp / "lb.log",
        health_url=f"http://127.0.0.1:{port}/health",
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ready_then_ordered_stop(tmp_path: Path) -> None:
    workers = [grpc_worker(tmp_path, "prefill-0"), grpc_worker(tmp_path, "decode-0")]
    lc = LocalCluster(
        workers, http_gateway(tmp_path), ready_timeout_s=30, stop_grace_s=5, err=io.StringIO()
    )
    lc.start()
    pids = [c.proc.pid for c in lc.children()]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    assert lc.dead_child() is None
    lc.stop()
    assert all(c.proc.returncode == 0 for c in lc.children()), (
        "children should exit cleanly on SIGTERM"
    )
    # The gateway stopped before the workers: its log has its SIGTERM line, and it was first.
    assert "stopped by SIGTERM" in (tmp_path / "lb.log").read_text()
    assert "stopped by SIGTERM" in (tmp_path / "decode-0.log").read_text()
    assert (tmp_path / "lb.log").stat().st_mtime <= (tmp_path / "decode-0.log").stat().st_mtime


def test_readiness_timeout_names_worker_and_prints_tail(tmp_path: Path) -> None:
    err = io.StringIO()
    never = grpc_worker(tmp_path, "decode-0", status="NOT_SERVING")
    lc = LocalCluster(
        [grpc_worker(tmp_path, "prefill-0"), never],
        http_gateway(tmp_path),
        ready_timeout_s=2.0,
        stop_grace_s=5,
        err=err,
    )
    t0 = time.monotonic()
    with pytest.raises(
        LaunchError, match=r"decode-0 was not SERVING .* within 2 s \(last health: NOT_SERVING"
    ):
        lc.start()
    assert time.monotonic() - t0 < 10
    assert (
        "grpc double" in err.getvalue() and "status=NOT_SERVING" in err.getvalue()
    )  # the log tail
    assert all(c.proc.poll() is not None for c in lc.children()), (
        "everything is stopped after a failure"
    )
    assert not (tmp_path / "lb.log").exists(), (
        "the gateway must not start before the workers are ready"
    )


def test_early_exit_prints_log_tail(tmp_path: Path) -> None:
    err = io.StringIO()
    crash = ProcessSpec(
        "prefill-0",
        [sys.executable, DOUBLE, "crash", "--code", "3"],
        tmp_path / "prefill-0.log",
        grpc_address=f"127.0.0.1:{free_port()}",
    )
    lc = LocalCluster(
        [crash, grpc_worker(tmp_path, "decode-0")],
        http_gateway(tmp_path),
        ready_timeout_s=60,
        stop_grace_s=5,
        err=err,
    )
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="prefill-0 exited with code 3 before it was ready"):
        lc.start()
    assert time.monotonic() - t0 < 20, "an early exit must not wait for the readiness deadline"
    assert "model weights not found (on purpose)" in err.getvalue()
    assert all(c.proc.poll() is not None for c in lc.children())


def test_child_death_after_ready_is_reported(tmp_path: Path) -> None:
    err = io.StringIO()
    lc = LocalCluster(
        [grpc_worker(tmp_path, "decode-0", exit_after=4.0)],
        http_gateway(tmp_path),
        ready_timeout_s=30,
        stop_grace_s=5,
        err=err,
    )
    lc.start()
    dead = lc.watch()
    assert dead is not None and dead.spec.name == "decode-0" and dead.proc.returncode == 7
    lc.stop()
    assert all(c.proc.poll() is not None for c in lc.children())


def test_dead_worker_is_restarted_until_restarts_run_out(tmp_path: Path) -> None:
    err = io.StringIO()
    lc = LocalCluster(
        [grpc_worker(tmp_path, "decode-0", exit_after=2.0)],
        http_gateway(tmp_path),
        ready_timeout_s=30,
        stop_grace_s=5,
        err=err,
        restart_workers=2,
    )
    lc.start()
    first_pid = lc.children()[0].proc.pid
    dead = lc.watch()  # two restarts, then the third exit ends the watch
    assert dead is not None and dead.spec.name == "decode-0" and dead.proc.pid != first_pid
    assert err.getvalue().count("restarting it") == 2
    lc.stop()
    assert all(c.proc.poll() is not None for c in lc.children())


def test_a_crashed_gateway_is_restarted_too(tmp_path: Path) -> None:
    """on_worker_exit: restart covers the gateway: killed, it comes back on its port; killed
    again with no restart left, the watch ends with it."""
    err = io.StringIO()
    lc = LocalCluster([grpc_worker(tmp_path, "decode-0")], http_gateway(tmp_path),
                      ready_timeout_s=30, stop_grace_s=5, err=err, restart_workers=1)
    lc.start()
    first = lc.children()[-1].proc.pid
    os.kill(first, signal.SIGKILL)

    def kill_the_restarted_one() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and lc.children()[-1].proc.pid == first:
            time.sleep(0.05)
        os.kill(lc.children()[-1].proc.pid, signal.SIGKILL)

    threading.Thread(target=kill_the_restarted_one, daemon=True).start()
    dead = lc.watch()
    assert dead is not None and dead.spec.name == "lb" and dead.proc.pid != first
    assert "lb exited with code -9; restarting it (0 restarts left)" in err.getvalue()
    assert lc.children()[0].proc.poll() is None  # the worker served on throughout
    lc.stop()


def test_request_stop_ends_watch(tmp_path: Path) -> None:
    lc = LocalCluster(
        [grpc_worker(tmp_path, "both-0")],
        None,
        ready_timeout_s=30,
        stop_grace_s=5,
        err=io.StringIO(),
    )
    lc.start()
    threading.Timer(0.3, lc.request_stop).start()
    assert lc.watch() is None
    lc.stop()
    assert lc.children()[0].proc.returncode == 0


def test_cluster_specs_follow_the_plan(tmp_path: Path) -> None:
    cluster = config_from_dict(
        {
            "roles": {
                "prefill": {"count": 2, "base_port": 51000},
                "decode": {"count": 1, "base_port": 52000},
            },
            "launcher": {"log_dir": str(tmp_path)},
        }
    )
    workers, gateway = cluster_specs(cluster, tmp_path / "cluster.yaml")
    assert [w.name for w in workers] == ["prefill-0", "prefill-1", "decode-0"]
    assert [w.grpc_address for w in workers] == [
        "127.0.0.1:51000",
        "127.0.0.1:51010",
        "127.0.0.1:52000",
    ]
    assert workers[1].argv[-6:] == [
        "--config",
        str(tmp_path / "cluster.yaml"),
        "--role",
        "prefill",
        "--replica",
        "1",
    ]
    run = tmp_path / "8000"  # the run directory: <log_dir>/<gateway port>
    assert workers[2].log_path == run / "decode-0.log"
    assert (
        gateway.log_path == run / "lb.log" and gateway.health_url == "http://127.0.0.1:8000/health"
    )
    assert workers[2].identity is not None and workers[2].identity.role == "decode"


@pytest.mark.parametrize("policy", ["stop", "restart"])
def test_a_crash_says_it_ends_the_cluster_and_how_to_restart_instead(policy: str) -> None:
    """`kill -9` of a launched worker ends the cluster by default: the line says so, and names
    the setting that restarts it instead (a newcomer took the stop for a launcher bug)."""
    text = crash_text(-9, policy)
    assert text.startswith("exited unexpectedly with code -9")
    assert ("--set launcher.on_worker_exit=restart" in text) == (policy == "stop"), text
    assert ("launcher.max_restarts" in text) == (policy == "restart"), text


def test_a_stop_during_start_up_says_what_it_stopped(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C before the ready line: the launcher stops what it started and says so in the
    same `stopped:` line as after it (it exited 0 in silence, the run dir unnamed)."""
    from orchestrator.config import REPO_ROOT, load_config
    from orchestrator.launch.local import run_local

    def start_then_interrupted(self: LocalCluster) -> None:
        self.request_stop()  # the signal handler's call, while the workers start

    monkeypatch.setattr(LocalCluster, "start", start_then_interrupted)
    cluster = load_config(REPO_ROOT / "configs" / "tiny-mono.yaml",
                          [f"launcher.log_dir={tmp_path}"])
    out, err = io.StringIO(), io.StringIO()
    assert run_local(cluster, out, err) == 0
    assert "ready: " not in out.getvalue()
    assert "stopped: nothing was running; logs in " in out.getvalue(), out.getvalue()
