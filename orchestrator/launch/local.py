"""The local launcher: the whole cluster as subprocesses of this machine.

Lifecycle:
  1. Before anything starts (orchestrator/launch/ports.py): draw the cluster id, pick free
     ports for the roles whose base_port is unset, and check that every port the cluster will
     listen on is free; a taken one fails at once, in one line naming the port, the process and
     the config key.
  2. A run directory of its own, `<log_dir>/<gateway port>/` (printed at start; the previous
     run's moves to `<...>.prev`, nothing is appended across runs). The resolved config goes to
     `cluster.yaml` there; every child reads that one file, so flags given to `tandem serve`
     (--model, --port, --set) and the cluster id reach every process.
  3. Start every worker (`python -m orchestrator.cli worker --role R --replica I`) in its own
     process group, stdout+stderr to `<run dir>/<role>-<i>.log`.
  4. Wait until each worker's gRPC health says SERVING and its GetInfo says it is the worker
     this launch started (cluster id, role, replica, model), up to launcher.ready_timeout_s. On
     a timeout or an early exit: stop everything, print the failed process's log tail, fail; on
     a stranger answering at a worker's address: stop everything, fail with one line.
  5. Start the gateway (`lb.log`), wait for HTTP /health 200 within the same deadline.
  6. Print `ready: http://HOST:PORT (model; workers, ranks, devices; transfer; cluster id;
     run dir)` (orchestrator/launch/describe.py) and watch:
     a worker that exits 0 has drained and left (DELETE /workers, or SIGTERM): the cluster
     serves on with the others; another exit ends the cluster with a non-zero status naming
     it (or restarts it, on_worker_exit: restart); SIGINT/SIGTERM end it cleanly.
  7. Ordered shutdown: the gateway first (no new requests), then the workers; SIGTERM (a
     worker drains, holding nothing by then), SIGKILL after launcher.stop_grace_s; prints what
     it stopped.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
from pathlib import Path
from typing import IO

from orchestrator.config import ClusterConfig, dial_address, dump_config
from orchestrator.launch.describe import ready_line, stopped_line
from orchestrator.launch.ports import check_ports, resolve_ports
from orchestrator.launch.processes import LaunchError, LocalCluster, ProcessSpec, stop_on_signals
from orchestrator.launch.run_dir import RunDir
from orchestrator.plan import preflight
from orchestrator.rank_map import plan_processes
from protocol.identity import WorkerIdentity, model_fingerprint


def run_dir_of(cluster: ClusterConfig) -> Path:
    """The cluster's own directory: launcher.run_dir, else <log_dir>/<gateway port>."""
    launcher = cluster.launcher
    return Path(launcher.run_dir or Path(launcher.log_dir) / str(cluster.gateway.port))


def expected_identity(cluster: ClusterConfig, role: str, replica: int) -> WorkerIdentity:
    """What the launch's worker `role`-`replica` must report in GetInfo."""
    m = cluster.model
    fp = model_fingerprint(cluster.served_model_name, m.path, m.load_format, m.seed)
    return WorkerIdentity(
        cluster_id=cluster.launcher.cluster_id, role=role, replica=replica, model_fingerprint=fp
    )


def cluster_specs(
    cluster: ClusterConfig, config_file: Path, log_dir: Path | None = None
) -> tuple[list[ProcessSpec], ProcessSpec]:
    """Worker and gateway process specs for a resolved config file written at `config_file`;
    logs in `log_dir` (default: the cluster's run directory)."""
    log_dir = log_dir or run_dir_of(cluster)
    base = [sys.executable, "-m", "orchestrator.cli"]
    workers = [
        ProcessSpec(
            name=row.name,
            argv=[
                *base,
                "worker",
                "--config",
                str(config_file),
                "--role",
                row.role,
                "--replica",
                str(row.replica),
            ],
            log_path=log_dir / f"{row.name}.log",
            grpc_address=dial_address(row.host, row.port),
            tls=cluster.tls,
            identity=expected_identity(cluster, row.role, row.replica),
        )
        for row in plan_processes(cluster)
        # a worker starts its node's other ranks itself
        if row.role != "gateway" and row.starts_node
    ]
    gw = cluster.gateway
    gateway = ProcessSpec(
        name="lb",
        argv=[*base, "gateway", "--config", str(config_file)],
        log_path=log_dir / "lb.log",
        health_url=f"http://{dial_address(gw.host, gw.port)}/health",
    )
    return workers, gateway


def prepare_launch(cluster: ClusterConfig) -> ClusterConfig:
    """The cluster as this launch runs it: its cluster id, every port chosen and checked free.

    Raises ClusterConfigError (PortInUseError: a taken port) before anything starts.
    """
    preflight(cluster)  # a bad checkpoint or layout: one line, not a worker's log tail
    cluster = resolve_ports(with_cluster_id(cluster))
    check_ports(cluster)
    return cluster


def with_cluster_id(cluster: ClusterConfig, cluster_id: str = "") -> ClusterConfig:
    """The config with its launch's cluster id: launcher.cluster_id if set, else `cluster_id`,
    else a fresh random one."""
    if cluster.launcher.cluster_id:
        return cluster
    launcher = dataclasses.replace(cluster.launcher, cluster_id=cluster_id or secrets.token_hex(4))
    return dataclasses.replace(cluster, launcher=launcher)


def crash_text(returncode: int | None, on_worker_exit: str) -> str:
    """What a child's death says: that it ends the cluster, and what would restart it."""
    if returncode == 0:  # only the gateway gets here with 0 (a worker's 0 is a drain)
        return "exited unexpectedly with code 0, which ends the cluster"
    if on_worker_exit == "restart":  # watch() returns a crash only once restarts are spent
        why = "no restarts left (launcher.max_restarts)"
    else:
        why = "--set launcher.on_worker_exit=restart restarts it instead"
    return f"exited unexpectedly with code {returncode}, which ends the cluster ({why})"


def run_local(
    cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    """Run the cluster in the foreground until Ctrl-C / SIGTERM (0) or a child's death (1)."""
    out, err = out or sys.stdout, err or sys.stderr
    # Fail before anything starts when the checkpoint or the layout is wrong (one line naming
    # the file and field), instead of after a worker's start-up and a log tail.
    for note in preflight(cluster):
        print(note, file=out, flush=True)
    cluster = prepare_launch(cluster)  # checks again (cheap: config.json and file headers)
    with RunDir(run_dir_of(cluster)) as run_dir:
        return _run(cluster, run_dir, out, err)


def _run(cluster: ClusterConfig, run_dir: Path, out: IO[str], err: IO[str]) -> int:
    """run_local once its run directory is made and held."""
    print(f"run dir: {run_dir} (cluster {cluster.launcher.cluster_id})", file=out, flush=True)
    config_file = (run_dir / "cluster.yaml").resolve()
    config_file.write_text(dump_config(cluster))
    config_file.chmod(0o600)  # it holds the api and admin keys
    workers, gateway = cluster_specs(cluster, config_file, run_dir)
    launcher = cluster.launcher
    restarts = launcher.max_restarts if launcher.on_worker_exit == "restart" else 0
    lc = LocalCluster(
        workers,
        gateway,
        launcher.ready_timeout_s,
        launcher.stop_grace_s,
        launcher.log_tail_lines,
        err=err,
        restart_workers=restarts,
    )
    with stop_on_signals(lc):
        try:
            lc.start()
        except LaunchError as exc:
            print(f"error: cluster did not start: {exc}", file=err)
            return 1
        code = 0
        if not lc.stop_requested:  # Ctrl-C during the start: straight to the stop
            print(ready_line(cluster, run_dir), file=out, flush=True)
            dead = lc.watch()
            if dead is not None:
                lc.report_failure(dead, crash_text(dead.proc.returncode, launcher.on_worker_exit))
                code = 1
        stopped = lc.stop()
    print(stopped_line(stopped, run_dir), file=out, flush=True)
    return code
