"""What one Slurm task knows about its allocation, and the files nodes share.

`read_slurm_env` reads SLURM_* (node list through `scontrol show hostnames`); `with_node_hosts`
gives every replica its node's address; `clear_topology_env` removes the task-layout variables
a worker's own ranks must not see. Nodes talk through files on the shared filesystem, written
then renamed (`publish`) and polled (`wait_files`): there is no inotify across nodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from orchestrator.config import ClusterConfig, ClusterConfigError
from orchestrator.launch.ports import check_ports
from orchestrator.launch.processes import LaunchError, LocalCluster
from orchestrator.rank_map import ProcessRow, plan_processes

# Variables that describe Slurm's task layout; a worker's own ranks must not see them
# (torch.distributed / NCCL / MPI integrations read SLURM_PROCID, SLURM_NTASKS, PMI_*).
_TOPOLOGY_PREFIXES = ("SLURM_", "SLURMD_", "PMI_", "PMIX_", "OMPI_")
FILE_POLL_S = 0.2  # readiness files live on a shared filesystem: no inotify across nodes


class SlurmEnvError(RuntimeError):
    """Not inside a usable Slurm allocation; the message says what is missing and the fix."""


@dataclass(frozen=True)
class SlurmEnv:
    """What one task knows about its allocation."""

    job_id: str
    step_id: str
    node_id: int  # this task's node index within the allocation (0 = the gateway's node)
    nodes: tuple[str, ...]  # host names in allocation order
    run_id: str  # TANDEM_RUN_ID from submit.sh; "" = none

    @property
    def run_name(self) -> str:
        return f"job{self.job_id}.{self.step_id}" + (f"-{self.run_id}" if self.run_id else "")


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """`n[1-2]` -> ("n1", "n2") through scontrol (Slurm's own grammar, not ours)."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SlurmEnvError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return tuple(out.stdout.split())


def read_slurm_env(environ: Mapping[str, str]) -> SlurmEnv:
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        raise SlurmEnvError(
            "launcher.kind=slurm runs inside a Slurm allocation (SLURM_JOB_ID is unset); "
            "submit with deploy/slurm/submit.sh JOB.yaml, or use launcher.kind=local"
        )
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
    return SlurmEnv(
        job_id=job,
        step_id=environ.get("SLURM_STEP_ID", "0"),
        node_id=int(environ.get("SLURM_NODEID", "0")),
        nodes=expand_nodelist(nodelist) if nodelist else (socket.gethostname(),),
        run_id=environ.get("TANDEM_RUN_ID", ""),
    )


def clear_topology_env(environ: MutableMapping[str, str]) -> list[str]:
    """Remove Slurm's task-layout variables; returns the names removed."""
    gone = [k for k in environ if k.startswith(_TOPOLOGY_PREFIXES)]
    for k in gone:
        del environ[k]
    return gone


def with_node_hosts(cluster: ClusterConfig, addresses: tuple[str, ...]) -> ClusterConfig:
    """Each replica's host = the address of its node 0 (plan order); the gateway stays put."""
    first = {
        (r.role, r.replica): r.node
        for r in plan_processes(cluster)
        if r.rank == 0 and r.role != "gateway"
    }
    roles = cluster.roles
    for name, rc in roles.present():
        hosts = tuple(addresses[first[(name, i)]] for i in range(rc.count))
        roles = dataclasses.replace(roles, **{name: dataclasses.replace(rc, hosts=hosts)})
    return dataclasses.replace(cluster, roles=roles)


def check_node_ports(cluster: ClusterConfig, node: int, address: str) -> None:
    """PortInUseError, naming the port and its key, for a port this node will listen on that
    is taken (another job on the node with the same ports), before any worker starts: else
    that job's worker answers there and node 0 only refuses a foreign worker."""
    check_ports(
        cluster, lambda ln: node == 0 if ln.who == "gateway" else ln.host == address
    )


def log_name(row: ProcessRow, count: int) -> str:
    """prefill, decode-1, prefill.node1: the issue's prefill.log / decode.log for 1P1D."""
    name = row.role if count == 1 else f"{row.role}-{row.replica}"
    return name + (f".node{row.node_rank}" if row.node_rank else "")


def publish(path: Path, data: dict[str, object]) -> None:
    """Write then rename: a reader on another node never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def wait_files(
    run_dir: Path,
    names: list[str],
    deadline: float,
    err: IO[str],
    tail_lines: int,
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Until ready/<name>.json exists for every name; LaunchError on a failed/ file, a timeout
    or `stopped()` (a signal: the job was cancelled while it waited)."""
    ready, failed = run_dir / "ready", run_dir / "failed"
    while True:
        if stopped():
            raise LaunchError("stopped by a signal while waiting for the other nodes")
        for f in sorted(failed.glob("*.json")) if failed.is_dir() else []:
            info = json.loads(f.read_text())
            print(
                f"--- last lines of {info.get('log')} ---\n{info.get('tail') or '(log is empty)'}",
                file=err,
                flush=True,
            )
            raise LaunchError(f"{f.stem} failed on node {info.get('node')}: {info.get('error')}")
        missing = [n for n in names if not (ready / f"{n}.json").is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise LaunchError(
                f"no readiness file from {', '.join(missing)} in {ready} before the deadline"
            )
        time.sleep(FILE_POLL_S)


def publish_stopped(run_dir: Path, node: int, status: int) -> None:
    """Node > 0's last word: stopped/node<i>.json. Node 0 exits once every node's mark is there
    and srun's --kill-on-bad-exit then signals the tasks still on their way out, so from here on
    this process ignores SIGTERM and SIGINT (it has nothing left to stop): it exits with its own
    code, not the 143 of a node terminated mid-exit, which would become the job's code."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
    publish(run_dir / "stopped" / f"node{node}.json", {"status": status})


def wait_stopped(run_dir: Path, nodes: int, timeout_s: float) -> None:
    """Until every node > 0 has published stopped/node<i>.json, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    marks = [run_dir / "stopped" / f"node{n}.json" for n in range(1, nodes)]
    while not all(m.is_file() for m in marks) and time.monotonic() < deadline:
        time.sleep(FILE_POLL_S)


def wait_done(run_dir: Path, deadline: float) -> bool:
    """Until node 0 has published done.json (True) or `deadline` (monotonic) passed (False)."""
    done = run_dir / "done.json"
    while not done.is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(FILE_POLL_S)
    return True


def stop_when_done(workers: LocalCluster, run_dir: Path) -> threading.Event:
    """Nodes > 0: stop this node's workers once node 0 publishes done.json (the run ended,
    well or not), while they start too. The event is set when the stop came from there."""
    ended = threading.Event()

    def watch() -> None:
        done = run_dir / "done.json"
        while not done.is_file() and not workers.stop_requested:
            time.sleep(FILE_POLL_S)
        if not workers.stop_requested:
            ended.set()
        workers.request_stop()

    threading.Thread(target=watch, name="watch-done", daemon=True).start()
    return ended


def end_failed_start(node: int, nodes: int, run_dir: Path, deadline: float, grace: float) -> int:
    """This node's worker failed to start (failed/<name>.json is published): end the run so
    that the job's code is node 0's 1. No node exits non-zero while another still runs:
    srun's --kill-on-bad-exit would signal it mid-start, and the job would end 143 or 137
    (Slurm's SIGKILL after KillWait), which reads as a cancel or an OOM kill."""
    if node == 0:  # the other nodes stop on done.json; exit after them
        publish(run_dir / "done.json", {"status": 1})
        wait_stopped(run_dir, nodes, grace)
        return 1
    publish_stopped(run_dir, node, 1)
    # Node 0 reads failed/ and ends the job with 1; without it by then, end it from here.
    return 0 if wait_done(run_dir, deadline + grace) else 1


class SubmitClock:
    """Seconds since submit.sh ran (TANDEM_SUBMIT_T0, epoch seconds; all nodes share the
    clock here) or else since this launcher started: the figures in docs/deploy.md."""

    def __init__(self, submit_t0: str = "") -> None:
        self.t0 = float(submit_t0) if submit_t0 else time.time()

    def __call__(self) -> str:
        return f"[{time.time() - self.t0:6.1f}s]"


# sbatch --time's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, and no limit.
_TIME_LIMIT = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|INFINITE|UNLIMITED")


def check_time_limit(limit: str) -> None:
    """launcher.slurm_time_limit in a form sbatch takes, or one line naming the field."""
    if not _TIME_LIMIT.fullmatch(limit):
        raise ClusterConfigError(
            f"launcher.slurm_time_limit: {limit!r} is not a Slurm time limit; use MINUTES, "
            "HH:MM:SS or DAYS-HH[:MM[:SS]] (e.g. 00:30:00), or INFINITE"
        )
