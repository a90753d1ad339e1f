"""The Ray launcher end to end on a real local Ray cluster: 1P1D serves and the gate passes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT, config_from_dict
from tests.deploy.conftest import real_model_present

pytest.importorskip("ray")

from orchestrator.launch.ray import bundle  # noqa: E402  (after the importorskip)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bundles_hold_a_replicas_ranks() -> None:
    c = config_from_dict(
        {
            "roles": {
                "prefill": {"parallel": {"tp_size": 4, "device": "cuda"}},
                "decode": {"base_port": 51000},
            },
            "launcher": {"kind": "ray"},
        }
    )
    assert bundle(c, "prefill") == {"CPU": 1.0, "GPU": 4.0}
    assert bundle(c, "decode") == {"CPU": 1.0}


RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _start_head(log: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    """`ray start --head` on a free port, its output in `log`; None when it exited before its
    GCS port accepted connections."""
    port = free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    with log.open("wb") as out:
        head = subprocess.Popen(
            [
                ray_bin,
                "start",
                "--head",
                "--block",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--disable-usage-stats",
            ],
            env={**os.environ, **RAY_ENV},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:  # the head is up once its GCS port accepts connections
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return head, port
        if head.poll() is not None:
            return None
        assert time.monotonic() < deadline, f"ray start --head not up in 60 s:\n{log.read_text()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real local Ray cluster (`ray start --head`), shared by this module's launches. The
    port is picked free before ray binds it (and ray binds more than it): a head that exits at
    once is started again, once, on another port."""
    logs = [tmp_path_factory.mktemp("ray") / f"head-{i}.log" for i in range(2)]
    started = _start_head(logs[0]) or _start_head(logs[1])
    assert started is not None, "ray start --head exited twice:\n" + "\n".join(
        log.read_text()[-2000:] for log in logs)
    head, port = started
    try:
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # stops the whole local cluster
        head.wait(timeout=60)


def launch_argv(tmp_path: Path, model: Path, address: str, *sets: str) -> list[str]:
    """`tandem launch` on Ray; its run directory is tmp_path/<gateway port>."""
    gw, p, d = free_port(), free_port(), free_port()
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "launch",
        "--config",
        "configs/tiny-1p1d.yaml",
        "--set",
        "launcher.kind=ray",
        "--set",
        f"launcher.ray_address={address}",
        "--set",
        "launcher.eval_on_ready=true",
        "--set",
        f"model.path={model}",
        "--set",
        f"launcher.log_dir={tmp_path}",
        "--set",
        f"gateway.port={gw}",
        "--set",
        f"roles.prefill.base_port={p}",
        "--set",
        f"roles.decode.base_port={d}",
        "--set",
        "launcher.ready_timeout_s=120",
        *sets,
    ]


def launch(tmp_path: Path, model: Path, address: str, *sets: str) -> tuple[int, str, float]:
    args = launch_argv(tmp_path, model, address, *sets)
    env = {**os.environ, **RAY_ENV}
    t0 = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=280, cwd=REPO_ROOT, env=env)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.ray
@pytest.mark.slow
def test_ray_1p1d_serves_and_runs_the_gate(ray_head: str, model_dir: Path, tmp_path: Path) -> None:
    samples = 100 if real_model_present() else 24
    rc, out, _ = launch(tmp_path, model_dir, ray_head, "--set", f"eval.samples={samples}")
    print(out)
    assert "ready: http://127.0.0.1:" in out and "(2 workers on Ray; cluster " in out
    assert f"/{samples})" in out and "failed requests" not in out  # every request was answered
    assert re.search(r"stopped: lb \(0\), prefill-0 \(\d+\), decode-0 \(\d+\); logs in ", out)
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]  # logs/<gateway port>/
    assert {"prefill-0.log", "decode-0.log", "lb.log", "cluster.yaml"} <= {
        p.name for p in run_dir.iterdir()
    }
    if real_model_present():
        assert rc == 0, out  # the gate passes on the embedded model
    else:
        assert rc == 1 and "FAIL: accuracy" in out  # plumbing checkpoint: fails on accuracy only


@pytest.mark.ray
@pytest.mark.slow
def test_ray_worker_dying_at_start_fails_with_its_log(
    ray_head: str, model_dir: Path, tmp_path: Path
) -> None:
    with socket.socket() as busy:  # the decode worker's port is taken: it dies binding it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, out, elapsed = launch(
            tmp_path,
            model_dir,
            ray_head,
            "--set",
            f"roles.decode.base_port={busy.getsockname()[1]}",
        )
    assert rc == 1
    assert (
        "decode-0 exited with code 1 before it was ready" in out
        and "--- last lines of decode-0.log" in out
    ), out
    assert elapsed < 90


@pytest.mark.ray
def test_ray_refuses_resources_no_node_has(ray_head: str, model_dir: Path, tmp_path: Path) -> None:
    rc, out, elapsed = launch(
        tmp_path, model_dir, ray_head, "--set", "roles.decode.parallel.device=cuda:0"
    )
    assert rc == 1 and "roles.decode needs 1 GPU per replica but the Ray cluster has 0" in out, out
    assert elapsed < 30  # at once, not after launcher.ready_timeout_s


@pytest.mark.ray
@pytest.mark.slow
def test_ray_ctrl_c_says_what_it_stopped(ray_head: str, model_dir: Path, tmp_path: Path) -> None:
    """Like the local launcher: SIGINT stops the gateway, then the workers, and one line names
    each with its exit status (a worker drains on SIGTERM and exits 0)."""
    argv = launch_argv(tmp_path, model_dir, ray_head, "--set", "launcher.eval_on_ready=false")
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, **RAY_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:  # until the ready line (or the launcher's exit)
            lines.append(line)
            if "ready: http://" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert f"stopped: lb (0), prefill-0 (0), decode-0 (0); logs in {run_dir.resolve()}" in out, out


@pytest.mark.ray
@pytest.mark.slow
def test_worker_logs_go_to_the_run_dir_it_prints(
    ray_head: str, model_dir: Path, tmp_path: Path
) -> None:
    """A relative launcher.log_dir (the default, `logs`) is the launcher's: the workers' logs
    went to `logs/<port>/` under the directory `ray start --head` was run from, while the
    launcher said `logs in <its cwd>/logs/<port>` (holding only lb.log and cluster.yaml)."""
    argv = launch_argv(tmp_path, model_dir, ray_head, "--set", "launcher.log_dir=logs",
                       "--set", "eval.samples=4")
    argv[argv.index("configs/tiny-1p1d.yaml")] = str(REPO_ROOT / "configs" / "tiny-1p1d.yaml")
    here = tmp_path / "cwd"  # not the head's working directory
    here.mkdir()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=here,
                          env={**os.environ, **RAY_ENV})
    out = proc.stdout + proc.stderr
    (run_dir,) = (here / "logs").iterdir()
    assert f"logs in {run_dir.resolve()}" in out, out
    assert {"prefill-0.log", "decode-0.log", "lb.log"} <= {p.name for p in run_dir.iterdir()}
    assert (run_dir / "prefill-0.log").stat().st_size > 0  # this run's worker wrote it


@pytest.mark.ray
@pytest.mark.slow
def test_a_workers_config_lives_in_the_run_dir_not_in_tmp(
    ray_head: str, model_dir: Path, tmp_path: Path
) -> None:
    """Each worker's resolved config (it holds the api and admin keys) went to a fresh
    /tmp/tandem-ray-XXXX/ that nothing removed: one directory per worker per launch, forever
    (338 on the dev box). It is now <run dir>/<worker>.cluster.yaml, readable by its owner."""
    rc, out, _ = launch(tmp_path, model_dir, ray_head, "--set", "eval.samples=4")
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    for name in ("prefill-0", "decode-0"):
        f = run_dir / f"{name}.cluster.yaml"
        assert f.is_file(), out
        assert f.stat().st_mode & 0o777 == 0o600


@pytest.mark.ray
def test_a_taken_gateway_port_is_refused_before_any_worker_starts(
    ray_head: str, model_dir: Path, tmp_path: Path
) -> None:
    """The gateway's port is on this machine: check it first, as the local launcher does.
    It was found taken only once Ray had placed and started both workers (the gateway's own
    refusal, seconds later, with the workers' logs written for nothing)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out, _ = launch(tmp_path, model_dir, ray_head, "--set", f"gateway.port={port}")
    assert rc != 0 and f"port {port} (gateway, gateway.port" in out, out
    assert "Connected to Ray cluster" not in out, out
    assert not list(tmp_path.glob("*/prefill-0.log")), out
