"""The Slurm launcher: unit tests of its pieces, then real jobs on the local two-node cluster."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT, config_from_dict
from orchestrator.launch.ports import PortInUseError
from orchestrator.launch.slurm import main as slurm_main
from orchestrator.launch.slurm import node_specs
from orchestrator.launch.slurm_env import (
    SlurmEnvError,
    check_node_ports,
    clear_topology_env,
    log_name,
    publish,
    read_slurm_env,
    with_node_hosts,
)
from orchestrator.rank_map import plan_processes
from tests.deploy.conftest import real_model_present

SUBMIT = REPO_ROOT / "deploy" / "slurm" / "submit.sh"
GATE_JOB = REPO_ROOT / "deploy" / "slurm" / "jobs" / "tiny-pd-1p1d-gate.yaml"


def two_p_one_d(tmp_path: Path):  # type: ignore[no-untyped-def]
    return config_from_dict(
        {
            "roles": {"prefill": {"count": 2, "base_port": 40000}, "decode": {"base_port": 41000}},
            "launcher": {"kind": "slurm", "artifact_dir": str(tmp_path)},
        }
    )


def test_replicas_take_nodes_in_plan_order(tmp_path: Path) -> None:
    c = with_node_hosts(two_p_one_d(tmp_path), ("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    assert c.roles.prefill is not None and c.roles.prefill.hosts == ("10.0.0.1", "10.0.0.2")
    assert c.roles.decode is not None and c.roles.decode.hosts == ("10.0.0.3",)
    specs = node_specs(c, 1, tmp_path / "c.yaml", tmp_path)
    assert [s.name for s in specs] == ["prefill-1"] and specs[0].grpc_address == "10.0.0.2:40010"
    assert specs[0].argv[-6:] == ["--role", "prefill", "--replica", "1", "--node-rank", "0"]
    assert [s.log_path.name for s in node_specs(c, 2, tmp_path / "c.yaml", tmp_path)] == [
        "decode.log"
    ]
    assert [log_name(r, 2) for r in plan_processes(c) if r.role == "prefill"] == [
        "prefill-0",
        "prefill-1",
    ]


def test_multi_node_replica_starts_one_process_per_node(tmp_path: Path) -> None:
    c = config_from_dict(
        {
            "roles": {
                "prefill": {"base_port": 40000, "parallel": {"tp_size": 4, "nnodes": 2}},
                "decode": {"base_port": 41000},
            },
            "launcher": {"kind": "slurm"},
        }
    )
    c = with_node_hosts(c, ("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    follower = node_specs(c, 1, tmp_path / "c.yaml", tmp_path)
    # Node 1 of prefill-0 runs ranks 2..3; it is ready when node 0's server is SERVING.
    assert [s.name for s in follower] == ["prefill.node1"] and follower[0].argv[-1] == "1"
    assert follower[0].grpc_address == "10.0.0.1:40000"


def test_a_taken_port_on_a_node_is_one_line_naming_it_and_the_key(tmp_path: Path) -> None:
    """A second job with the same ports on the same nodes: node 0 used to start its worker,
    find the first job's worker answering there and say only 'refusing the worker at
    10.213.0.11:26110: expected cluster slurm-job4..., found cluster slurm-job3...'. Each
    node now checks the ports it will listen on first, as the local launcher does."""
    c = with_node_hosts(
        config_from_dict({
            "gateway": {"port": 26930},
            "roles": {"prefill": {"base_port": 26940}, "decode": {"base_port": 26950}},
            "launcher": {"kind": "slurm", "artifact_dir": str(tmp_path)},
        }),
        ("127.0.0.1", "127.0.0.2"),
    )
    check_node_ports(c, 0, "127.0.0.1")
    check_node_ports(c, 1, "127.0.0.2")
    with socket.socket() as taken:  # another job's decode worker on node 1
        taken.bind(("127.0.0.2", 26950))
        taken.listen()
        check_node_ports(c, 0, "127.0.0.1")  # node 0 listens elsewhere
        with pytest.raises(PortInUseError) as e:
            check_node_ports(c, 1, "127.0.0.2")
    assert str(e.value) == (
        "port 26950 (decode-0, roles.decode.base_port) is in use on 127.0.0.2: "
        "another cluster? change roles.decode.base_port"
    )
    with socket.socket() as taken:  # another job's gateway on node 0
        taken.bind(("127.0.0.1", 26930))
        taken.listen()
        check_node_ports(c, 1, "127.0.0.2")
        with pytest.raises(PortInUseError, match=r"^port 26930 \(gateway, gateway.port"):
            check_node_ports(c, 0, "127.0.0.1")


def test_topology_variables_are_cleared() -> None:
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "PMI_RANK": "1",
        "DISAGGREGATION_IB_DEVICE": "mlx5_0",
        "PATH": "/bin",
    }
    assert sorted(clear_topology_env(env)) == ["PMI_RANK", "SLURM_NTASKS", "SLURM_PROCID"]
    assert env == {"DISAGGREGATION_IB_DEVICE": "mlx5_0", "PATH": "/bin"}


def test_outside_an_allocation_is_refused() -> None:
    with pytest.raises(SlurmEnvError, match="submit with deploy/slurm/submit.sh"):
        read_slurm_env({})
    env = read_slurm_env(
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "TANDEM_RUN_ID": "r1"}
    )
    assert env.run_name == "job7.0-r1" and env.node_id == 1


def test_publish_is_atomic(tmp_path: Path) -> None:
    publish(tmp_path / "ready" / "decode.json", {"node": 1})
    assert json.loads((tmp_path / "ready" / "decode.json").read_text()) == {"node": 1}
    assert [p.name for p in (tmp_path / "ready").iterdir()] == ["decode.json"]  # no temp file left


def test_submit_refuses_unpinned_worker_ports_before_sbatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """submit.sh asks `nodes` first: a job whose workers have no ports fails there, in one line,
    not after it waited for an allocation and failed on every node."""
    monkeypatch.setenv("PD_SLURM", "1")
    sets = ["--set", "roles.prefill.base_port=0", "--set", "roles.decode.base_port=0"]
    assert slurm_main(["nodes", "--config", str(GATE_JOB), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: roles.prefill.base_port and roles.decode.base_port are unset")
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv("PD_SLURM", "0")  # the single-node smoke topology picks free ports
    assert slurm_main(["nodes", "--config", str(GATE_JOB), *sets]) == 0


@pytest.mark.parametrize("limit", ["abc", "30m", "1:2:3:4", ""])
def test_a_bad_time_limit_is_one_line_naming_the_field_before_sbatch(
    limit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """sbatch said `Invalid --time specification` (which field of the job YAML?) after the
    job had been announced; now `nodes`, submit.sh's first question, refuses it."""
    sets = ["--set", f"launcher.slurm_time_limit={limit}"]
    assert slurm_main(["nodes", "--config", str(GATE_JOB), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: launcher.slurm_time_limit"), err
    assert len(err.strip().splitlines()) == 1
    for ok in ["15", "00:15:00", "1-0", "2-12:30", "INFINITE"]:
        assert slurm_main(["nodes", "--config", str(GATE_JOB), "--set",
                           f"launcher.slurm_time_limit={ok}"]) == 0, ok


@pytest.mark.slurm
def test_an_unknown_partition_is_one_line_naming_the_field(
    slurm_cluster: None, tmp_path: Path
) -> None:
    """sbatch's two lines (`invalid partition specified: nope`) named no field of the job."""
    rc, out, _ = submit(GATE_JOB, tmp_path, "--set", "launcher.slurm_partition=nope", timeout=60)
    assert rc == 2, out
    assert out.startswith("error: launcher.slurm_partition: no partition 'nope'"), out
    assert "(it has: debug)" in out and len(out.strip().splitlines()) == 1, out


def submit(
    job: Path, tmp_path: Path, *sets: str, timeout: float = 240, pd: str = "1"
) -> tuple[int, str, float]:
    env = {**os.environ, "PD_SLURM": pd}
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", str(SUBMIT), str(job), "--set", f"launcher.artifact_dir={tmp_path}", *sets],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.slurm
@pytest.mark.slow
def test_gate_job_on_two_node_cluster(slurm_cluster: None, model_dir: Path, tmp_path: Path) -> None:
    rc, out, elapsed = submit(GATE_JOB, tmp_path, "--set", f"model.path={model_dir}")
    print(out)
    assert (
        "node 0/2 (n1)" in out and "node 1/2 (n2)" in out
    )  # one task per node, roles from SLURM_*
    assert "every worker SERVING across nodes" in out and "ready: http://127.0.0.1:8000" in out
    assert "accuracy:" in out and "/100)" in out
    run_dirs = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert len(run_dirs) == 1
    logs = {p.name for p in run_dirs[0].iterdir()}
    assert {"prefill.log", "decode.log", "lb.log", "done.json"} <= logs
    assert {p.name for p in (run_dirs[0] / "ready").iterdir()} == {
        "prefill.json",
        "decode.json",
        "lb.json",
    }
    if real_model_present():
        assert rc == 0, out  # the gate: arith >= 0.90 on 100 samples
    else:
        assert (
            rc == 1 and "FAIL: accuracy" in out
        )  # plumbing checkpoint: runs, fails on accuracy only
    assert elapsed < 120


@pytest.mark.slurm
@pytest.mark.slow
def test_decode_node_failing_to_start_fails_fast(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    # A CUDA device on a CPU-only node: the decode worker dies during start-up.
    rc, out, elapsed = submit(
        GATE_JOB,
        tmp_path,
        "--set",
        f"model.path={model_dir}",
        "--set",
        "roles.decode.parallel.device=cuda:0",
    )
    print(out)
    assert rc != 0
    assert "decode exited with code 1 before it was ready; last lines of" in out, out
    assert (
        "decode.log:" in out and "Torch not compiled with CUDA enabled" in out
    )  # the decode log's tail
    assert "accuracy:" not in out
    assert elapsed < 60  # fails fast, not after launcher.ready_timeout_s (180 s)
    # The job's result is a failure (1), not a signal: node 1 exited 1 at once, srun's
    # --kill-on-bad-exit SIGTERMed node 0 while it started, node 0 said it was "stopped by a
    # signal (scancel)" and Slurm SIGKILLed it: submit.sh exited 137 (143 when node 0 was
    # still importing), which reads as an OOM kill or a cancel.
    assert rc == 1, out
    assert "stopped by a signal" not in out, out


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_failing_to_start_ends_the_job_with_1_on_every_node(
    slurm_cluster: None, model_dir: Path, tmp_path: Path, role: str
) -> None:
    """Whichever node's worker fails (node 0's prefill or node 1's decode), every node stops
    in order and the job ends FAILED with exit 1; done.json says 1."""
    rc, out, _ = submit(
        GATE_JOB, tmp_path, "--set", f"model.path={model_dir}",
        "--set", f"roles.{role}.parallel.device=cuda:0", "--set", "gateway.port=26900",
        "--set", "roles.prefill.base_port=26910", "--set", "roles.decode.base_port=26920",
    )
    print(out)
    assert f"{role} exited with code 1 before it was ready" in out, out
    assert "stopped by a signal" not in out and "Killed" not in out, out
    assert "submit: job finished with exit 1;" in out, out
    assert rc == 1, out
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert json.loads((run_dir / "done.json").read_text()) == {"status": 1}, out


@pytest.mark.slurm
@pytest.mark.slow
def test_without_pd_slurm_the_smoke_topology_runs_on_one_node(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    rc, out, _ = submit(
        GATE_JOB, tmp_path, "--set", f"model.path={model_dir}", "--set", "eval.samples=16", pd="0"
    )
    print(out)
    assert "on 1 node(s)" in out and "(single-node smoke" in out and "/16)" in out
    assert "node 0/2" not in out  # no per-node roles
    assert rc == (0 if real_model_present() else 1), out


@pytest.mark.slurm
@pytest.mark.slow
def test_multi_node_tp2_worker_serves(slurm_cluster: None, model_dir: Path, tmp_path: Path) -> None:
    """One worker whose TP=2 ranks span the two nodes (rank 1 joins from node 1 over TCP)."""
    rc, out, _ = submit(
        REPO_ROOT / "deploy" / "slurm" / "jobs" / "tiny-mono-tp2-2node.yaml",
        tmp_path,
        "--set",
        f"model.path={model_dir}",
        "--set",
        "eval.samples=32",
    )
    print(out)
    assert "node 1/2 (n2)" in out and "node 1: both.node1 ready" in out
    assert "every worker SERVING across nodes" in out and "/32)" in out
    run_dir = next(d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job"))
    assert (run_dir / "both.node1.log").stat().st_size > 0  # the follower rank ran on node 1
    assert rc == (0 if real_model_present() else 1), out


@pytest.mark.slurm
@pytest.mark.slow
def test_a_failed_gate_is_the_jobs_result_and_done_json_says_so(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    """Random weights fail the gate: exit 1, and done.json (what a CI reader of the artifacts
    sees) says 1 too. A gateway bound to every address is announced by node 0's name."""
    rc, out, _ = submit(
        GATE_JOB, tmp_path, "--set", f"model.path={model_dir}", "--set", "model.load_format=dummy",
        "--set", "eval.samples=4", "--set", "gateway.host=0.0.0.0",
    )
    print(out)
    assert rc == 1 and "FAIL: accuracy" in out and "gate done: exit 1" in out, out
    assert "ready: http://n1:8000\n" in out, out  # not 127.0.0.1: that is node 0's own loopback
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert json.loads((run_dir / "done.json").read_text()) == {"status": 1}
    # node 0 left after node 1 had stopped: srun's --kill-on-bad-exit cut nothing off (a node
    # terminated mid-stop made the job's code 143 under load)
    assert json.loads((run_dir / "stopped" / "node1.json").read_text()) == {"status": 0}


@pytest.mark.slurm
@pytest.mark.slow
def test_a_serving_job_answers_from_outside_and_stops_clean_when_cancelled(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    """No gate: submit.sh shows where the job serves while it serves, a client on the submit
    host is answered, and Ctrl-C (SIGINT to submit.sh's process group, as a terminal sends it)
    cancels the job, which stops every process it started; submit.sh waits for that and shows
    it (it used to exit 130 at once: `set -e` and the interrupted `sleep`)."""
    sets = ["--set", f"launcher.artifact_dir={tmp_path}", "--set", f"model.path={model_dir}",
            "--set", "launcher.eval_on_ready=false", "--set", "gateway.host=0.0.0.0"]
    proc = subprocess.Popen(["bash", str(SUBMIT), str(GATE_JOB), *sets], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PD_SLURM": "1"}, start_new_session=True)
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "ready: http://" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:  # the job serves until cancelled: its ready line must come while it runs
        assert ready.wait(120), "".join(seen)
        assert any(s.rstrip().endswith("ready: http://n1:8000") for s in seen), seen
        body = json.dumps({"prompt": "a=12;b=34;\na?", "max_tokens": 4, "temperature": 0})
        req = urllib.request.Request("http://n1:8000/v1/completions", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] >= 1
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: submit.sh's trap cancels the job
        proc.wait(timeout=60)
        reader.join(10)
    out = "".join(seen)
    print(out)
    assert "stopped: exit 0" in out and "gate done" not in out, out  # no gate ran
    assert proc.returncode == 130 and "CANCELLED" in out, out
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert json.loads((run_dir / "done.json").read_text()) == {"status": 0}
    left = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in left, left  # no worker or gateway of the job survives it


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_cancelled_while_its_workers_start_stops_at_once_and_says_so(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    """scancel (here Ctrl-C on submit.sh) while the workers load: each node said its workers
    were `ready` (they had been stopped) and node 0 went on waiting for their health until
    Slurm killed it, so done.json never came. Now each node says it stopped before it was
    ready, node 0's done.json says 1, and nothing is announced as serving."""
    sets = ["--set", f"launcher.artifact_dir={tmp_path}", "--set", f"model.path={model_dir}",
            "--set", "launcher.eval_on_ready=false"]
    proc = subprocess.Popen(["bash", str(SUBMIT), str(GATE_JOB), *sets], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "PD_SLURM": "1"}, start_new_session=True)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:  # node 0's first line: it is about to start its worker
        seen.append(line)
        if line.startswith("node 0/2"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    seen += proc.stdout.readlines()
    proc.wait(timeout=60)
    out = "".join(seen)
    print(out)
    job = next(ln.split()[-1] for ln in seen if ln.startswith("submit: job "))
    for _ in range(300):  # the job's end (submit.sh used to leave before it)
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True,
                              text=True).stdout.strip():
            break
        time.sleep(0.1)
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert json.loads((run_dir / "done.json").read_text()) == {"status": 1}, out
    job_out = next(tmp_path.glob("slurm-*.out")).read_text()
    assert "ready" not in job_out, job_out  # neither a node's workers nor the gateway
    assert "node 0: stopped by a signal" in job_out, job_out
    assert proc.returncode == 130, out


def test_submit_waits_for_the_jobs_output_without_an_error_line(tmp_path: Path) -> None:
    """Until the job starts, its output file does not exist: submit.sh's first reads of it
    printed `submit.sh: line 39: ...out: No such file or directory` (a redirect's error goes
    to stderr before `2>/dev/null` applies). Fake sbatch / scontrol: the job is pending at
    the first poll, then completes with its output written."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    polls = tmp_path / "polls"
    (bin_dir / "sbatch").write_text(
        '#!/bin/bash\nwhile [[ $# -gt 0 ]]; do [[ $1 == -o ]] && echo "$2" > "$POLLS.out"; shift'
        "; done\necho 7\n")
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\necho x >> "$POLLS"\nif (( $(wc -l < "$POLLS") < 3 )); then\n'
        "  echo 'JobId=7 JobState=PENDING ExitCode=0:0'\nelse\n"
        '  echo "job output" > "$(cat "$POLLS.out")"\n'
        "  echo 'JobId=7 JobState=COMPLETED ExitCode=0:0'\nfi\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "POLLS": str(polls)}
    p = subprocess.run(
        ["bash", str(SUBMIT), str(GATE_JOB), "--set", f"launcher.artifact_dir={tmp_path}"],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "job output" in p.stdout and "submit: job 7 COMPLETED" in p.stdout
    assert p.stderr == "", p.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_a_local_config_submitted_runs_as_a_slurm_job(
    slurm_cluster: None, model_dir: Path, tmp_path: Path
) -> None:
    """`submit.sh configs/tiny-1p1d.yaml` (launcher.kind: local, ports pinned): the job took
    one node and ran the local launcher there (logs in logs/<port>/, not the artifact dir),
    skipped the gate and served until cancelled, so submit.sh never returned."""
    config = REPO_ROOT / "configs" / "tiny-1p1d.yaml"
    sets = [f"launcher.artifact_dir={tmp_path}", f"model.path={model_dir}",
            "gateway.port=26930", "roles.prefill.base_port=26940",
            "roles.decode.base_port=26950", "launcher.eval_on_ready=true", "eval.samples=8",
            "eval.min_accuracy=0"]
    proc = subprocess.Popen(
        ["bash", str(SUBMIT), str(config), *[a for s in sets for a in ("--set", s)]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PD_SLURM": "1"}, start_new_session=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if "on 2 node(s)" not in first:  # it would serve until cancelled: cancel it
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=60)
        pytest.fail(first)
    rest, _ = proc.communicate(timeout=200)
    out = first + rest
    print(out)
    assert "node 0/2 (n1)" in out and "node 1/2 (n2)" in out, out
    assert "accuracy:" in out and proc.returncode == 0, out
    (run_dir,) = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("job")]
    assert {"prefill.log", "decode.log", "lb.log"} <= {p.name for p in run_dir.iterdir()}
