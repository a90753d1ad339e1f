"""The Slurm launcher: one `tandem launch` per node of an allocation (`srun --ntasks-per-node=1`).

Lifecycle with PD_SLURM=1 (every node runs this same code, told apart by SLURM_NODEID):
  1. Read the allocation from SLURM_* (node list through `scontrol show hostnames`) and check
     it has the nodes the plan needs (plan.num_nodes). Each replica gets nodes of its own in
     launch order: node 0 = prefill-0 (+ the gateway and the eval client), then decode, ...
  2. Resolve the config: every replica's host is its node's address, so a worker binds there
     and peers dial it. Clear Slurm's topology variables (SLURM_PROCID, SLURM_NTASKS, ...)
     from our environment: the workers' own torch.distributed ranks must not read them.
  3. Start this node's worker processes (one per replica node; its local rank 0 spawns the
     node's other ranks), logs `prefill.log` / `decode.log` in the run's artifact directory.
  4. Wait for their gRPC health SERVING, then publish `ready/<name>.json` (write, then rename).
     A worker that fails publishes `failed/<name>.json`, prints its log tail and the node
     exits 1 (srun --kill-on-bad-exit ends the step at once).
  5. Node 0: wait for every node's readiness file, check every worker's gRPC health across
     nodes, start the gateway (`lb.log`), wait for /health, publish `ready/lb.json`; with
     launcher.eval_on_ready run the eval gate against 127.0.0.1, publish `done.json`, stop,
     exit with the gate's status. Without it, serve until the job is cancelled.
  6. Other nodes: serve until `done.json` appears or a worker dies, then stop.

Without PD_SLURM=1: the single-node smoke topology — node 0 runs the whole cluster (as the
local launcher would) and the gate; other tasks exit 0 at once.

The run's artifact directory `<launcher.artifact_dir>/job<J>.<step>-<run id>` is unique per
run: Slurm job ids restart when a cluster's state is wiped, so submit.sh adds TANDEM_RUN_ID.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import IO, Any

from orchestrator.config import ClusterConfig, dial_address, dump_config, resolve_config_path
from orchestrator.config_checks import WILDCARD_HOSTS
from orchestrator.launch.local import (
    cluster_specs,
    expected_identity,
    prepare_launch,
    with_cluster_id,
)
from orchestrator.launch.ports import PortInUseError, require_pinned
from orchestrator.launch.processes import (
    LaunchError,
    LocalCluster,
    ProcessSpec,
    stop_on_signals,
    tail,
)
from orchestrator.launch.readiness import HealthWatch, identity_problem
from orchestrator.launch.slurm_env import (
    FILE_POLL_S,
    SlurmEnv,
    SlurmEnvError,
    SubmitClock,
    check_node_ports,
    check_time_limit,
    clear_topology_env,
    end_failed_start,
    log_name,
    publish,
    publish_stopped,
    read_slurm_env,
    stop_when_done,
    wait_files,
    wait_stopped,
    with_node_hosts,
)
from orchestrator.plan import preflight
from orchestrator.rank_map import num_nodes, plan_processes
from protocol.tls import TLSConfig

# scancel (or Ctrl-C on submit.sh) while a node started: what the node says, and node 0's
# done.json status then (the job's state is CANCELLED either way).
STOPPED_WHILE_STARTING = "stopped by a signal (scancel) while the cluster started"


def node_specs(
    cluster: ClusterConfig, node: int, config_file: Path, run_dir: Path
) -> list[ProcessSpec]:
    """The worker processes node `node` starts; readiness = its replica's gRPC SERVING."""
    base = [sys.executable, "-m", "orchestrator.cli", "worker", "--config", str(config_file)]
    specs = []
    for row in plan_processes(cluster):
        if row.role == "gateway" or row.node != node or not row.starts_node:
            continue
        rc = cluster.role(row.role)
        specs.append(
            ProcessSpec(
                name=log_name(row, rc.count),
                argv=[
                    *base,
                    "--role",
                    row.role,
                    "--replica",
                    str(row.replica),
                    "--node-rank",
                    str(row.node_rank),
                ],
                log_path=run_dir / f"{log_name(row, rc.count)}.log",
                # A node > 0 of a multi-node replica serves nothing itself: it is ready when its
                # replica (node 0's gRPC server, which waits for every rank) is.
                grpc_address=dial_address(rc.host_of(row.replica), rc.port(row.replica)),
                identity=expected_identity(cluster, row.role, row.replica),
            )
        )
    return specs


def _check_health(
    specs: list[ProcessSpec], deadline: float, tls: TLSConfig, stopped: Callable[[], bool]
) -> None:
    """Every worker answers gRPC health SERVING from this node (cross-node reachability), and
    is the worker this job started (a worker of an earlier job may still listen there)."""
    wake = threading.Event()
    watches = [HealthWatch(s.grpc_address, wake, tls) for s in specs]
    try:
        for w in watches:
            w.start(max(0.1, deadline - time.monotonic()))
        for w, spec in zip(watches, specs, strict=True):
            while not w.ready.is_set() and time.monotonic() < deadline and not stopped():
                w.ready.wait(FILE_POLL_S)
            if stopped():
                raise LaunchError(STOPPED_WHILE_STARTING)
            if not w.ready.is_set():
                raise LaunchError(
                    f"worker {w.address} is not SERVING from node 0 (last health: "
                    f"{w.last_status}); check the nodes' network and the role's "
                    "host/port"
                )
            problem = (
                identity_problem(spec.grpc_address, spec.identity, tls) if spec.identity else ""
            )
            if problem:
                raise LaunchError(problem)
    finally:
        for w in watches:
            w.close()


def run_gate(cluster: ClusterConfig, out: IO[str], err: IO[str]) -> int:
    """The config's eval gate against the gateway on this node; 0 when it passes."""
    from orchestrator.eval import report, run_eval
    from orchestrator.tasks import TaskMode, get_task

    gw, ev = cluster.gateway, cluster.eval
    url = f"http://127.0.0.1:{gw.port}"
    print(
        f"eval: {ev.task} x{ev.samples} at concurrency {ev.concurrency} against {url}",
        file=out,
        flush=True,
    )
    task = get_task(ev.task)
    run: Any = run_eval
    if task.MODE is TaskMode.TOOL_LOOP:  # as `tandem eval` runs it: the chat tool loop
        from orchestrator.eval_tools import run_tool_eval  # lazy: imports the openai client

        run = run_tool_eval
    result = asyncio.run(run(url, task, ev.samples, ev.concurrency, ev.seed, "", gw.api_key))
    return report(result, ev.min_accuracy, out, err)


def run_slurm(
    cluster: ClusterConfig,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> int:
    """One node's part of a Slurm run; returns this task's exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    environ = os.environ if environ is None else environ
    env = read_slurm_env(environ)
    clear_topology_env(environ)
    pd = environ.get("PD_SLURM", "") == "1"
    run_dir = (Path(cluster.launcher.artifact_dir) / env.run_name).resolve()
    if not pd:
        return _run_smoke(cluster, env, run_dir, out, err) if env.node_id == 0 else 0
    need = num_nodes(cluster)
    if len(env.nodes) < need:
        raise SlurmEnvError(
            f"the plan needs {need} nodes (one per replica node, PD_SLURM=1) "
            "but the allocation has "
            f"{len(env.nodes)} ({','.join(env.nodes)}); submit with -N {need} (submit.sh does)"
        )
    require_pinned(cluster, "slurm")
    notes = preflight(cluster)  # the checkpoint and the layout: one line, before any process
    addresses = tuple(socket.gethostbyname(n) for n in env.nodes)
    # Every node derives the same cluster id from the job, so they agree without talking.
    resolved = with_node_hosts(with_cluster_id(cluster, f"slurm-{env.run_name}"), addresses)
    config_file = run_dir / f"cluster.node{env.node_id}.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(dump_config(resolved))
    print(
        f"node {env.node_id}/{len(env.nodes)} ({env.nodes[env.node_id]}): run dir {run_dir}",
        *notes, sep="\n", file=out, flush=True,
    )
    clock = SubmitClock(environ.get("TANDEM_SUBMIT_T0", ""))
    return _run_node(resolved, env, run_dir, config_file, out, err, clock)


def _run_node(
    cluster: ClusterConfig,
    env: SlurmEnv,
    run_dir: Path,
    config_file: Path,
    out: IO[str],
    err: IO[str],
    clock: SubmitClock,
) -> int:
    launcher = cluster.launcher
    deadline = time.monotonic() + launcher.ready_timeout_s
    specs = node_specs(cluster, env.node_id, config_file, run_dir)
    workers = LocalCluster(
        specs,
        None,
        launcher.ready_timeout_s,
        launcher.stop_grace_s,
        launcher.log_tail_lines,
        err=err,
    )
    gateway: LocalCluster | None = None
    grace = launcher.stop_grace_s + 10
    with stop_on_signals(workers):
        ended = stop_when_done(workers, run_dir) if env.node_id != 0 else threading.Event()
        try:
            check_node_ports(cluster, env.node_id, socket.gethostbyname(env.nodes[env.node_id]))
            workers.start()
        except (LaunchError, PortInUseError) as exc:
            for s in specs:
                publish(
                    run_dir / "failed" / f"{s.name}.json",
                    {
                        "node": env.node_id,
                        "error": str(exc),
                        "log": str(s.log_path),
                        "tail": tail(s.log_path, launcher.log_tail_lines),
                    },
                )
            print(f"error: node {env.node_id}: {exc}", file=err, flush=True)
            return end_failed_start(env.node_id, num_nodes(cluster), run_dir, deadline, grace)
        if workers.stop_requested:  # start() returned early: nothing of ours is ready
            workers.stop()
            why = "node 0 ended the run" if ended.is_set() else STOPPED_WHILE_STARTING
            print(f"{clock()} node {env.node_id}: {why}", file=out, flush=True)
            if env.node_id == 0:
                publish(run_dir / "done.json", {"status": 1})
                wait_stopped(run_dir, num_nodes(cluster), grace)
            else:
                publish_stopped(run_dir, env.node_id, 1)
            return 0 if ended.is_set() else 1  # node 0's code is the job's
        for s in specs:
            publish(
                run_dir / "ready" / f"{s.name}.json",
                {"node": env.node_id, "address": s.grpc_address},
            )
        print(
            f"{clock()} node {env.node_id}: "
            f"{', '.join(s.name for s in specs) or 'no workers'} ready",
            file=out,
            flush=True,
        )
        if env.node_id != 0:
            code = _serve_until_done(workers)
            publish_stopped(run_dir, env.node_id, code)
            return code
        try:
            all_workers = [
                s.name
                for n in range(num_nodes(cluster))
                for s in node_specs(cluster, n, config_file, run_dir)
            ]
            wait_files(
                run_dir, all_workers, deadline, err, launcher.log_tail_lines,
                stopped=lambda: workers.stop_requested,
            )
            _check_health(
                [
                    s
                    for n in range(num_nodes(cluster))
                    for s in node_specs(cluster, n, config_file, run_dir)
                ],
                deadline,
                cluster.tls,
                lambda: workers.stop_requested,
            )
            print(
                f"{clock()} node 0: every worker SERVING across nodes; starting the gateway",
                file=out,
                flush=True,
            )
            _, gw_spec = cluster_specs(cluster, config_file, run_dir)
            gateway = LocalCluster(
                [],
                gw_spec,
                max(1.0, deadline - time.monotonic()),
                launcher.stop_grace_s,
                launcher.log_tail_lines,
                err=err,
            )
            with stop_on_signals(gateway):  # a signal now must cut the gateway's wait short too
                gateway.start()
            if gateway.stop_requested:
                workers.request_stop()
                raise LaunchError(STOPPED_WHILE_STARTING)
        except LaunchError as exc:
            print(f"error: cluster did not start: {exc}", file=err, flush=True)
            publish(run_dir / "done.json", {"status": 1})
            if gateway is not None:
                gateway.stop()
            workers.stop()
            wait_stopped(run_dir, num_nodes(cluster), launcher.stop_grace_s + 10)
            return 1
        url = gateway_url(cluster.gateway.host, cluster.gateway.port, env.nodes[0])
        publish(run_dir / "ready" / "lb.json", {"node": 0, "url": url.split()[0]})
        print(f"{clock()} ready: {url}", file=out, flush=True)
        code = 1  # what done.json says if the gate or the serving loop raises
        try:
            if launcher.eval_on_ready:
                code = run_gate(cluster, out, err)
                print(f"{clock()} gate done: exit {code}", file=out, flush=True)
            else:
                code = _serve_forever(workers, gateway)
                print(f"{clock()} stopped: exit {code}", file=out, flush=True)
        finally:
            publish(run_dir / "done.json", {"status": code})
            gateway.stop()
            workers.stop()
            # The other nodes stop on done.json; node 0 exits after them, so that srun's
            # --kill-on-bad-exit never cuts them off (the job's code is then this one, not a
            # 143 of a node terminated mid-stop).
            wait_stopped(run_dir, num_nodes(cluster), launcher.stop_grace_s + 10)
    return code


def gateway_url(host: str, port: int, node: str) -> str:
    """Where node 0's gateway is reached: a wildcard bind by the node's name (from the submit
    host too); any other host as it is, with the node it is on (127.0.0.1 is node 0's own)."""
    if host in WILDCARD_HOSTS:
        return f"http://{node}:{port}"
    return f"http://{host}:{port} (on {node}; gateway.host=0.0.0.0 serves other hosts)"


def _serve_forever(workers: LocalCluster, gateway: LocalCluster) -> int:
    """Without a gate: serve until a signal (0) or a process's death (1)."""

    def gateway_gone() -> None:
        gateway.watch()
        workers.request_stop()

    threading.Thread(target=gateway_gone, daemon=True).start()
    dead = workers.watch()
    if dead is not None:
        workers.report_failure(dead, f"exited unexpectedly with code {dead.proc.returncode}")
    return 0 if dead is None else 1


def _serve_until_done(workers: LocalCluster) -> int:
    """Nodes > 0: keep the workers up until node 0 publishes done.json (stop_when_done) or a
    worker dies."""
    dead = workers.watch()
    code = 0
    if dead is not None:
        workers.report_failure(dead, f"exited unexpectedly with code {dead.proc.returncode}")
        code = 1
    workers.stop()
    return code


def _run_smoke(
    cluster: ClusterConfig, env: SlurmEnv, run_dir: Path, out: IO[str], err: IO[str]
) -> int:
    """Without PD_SLURM=1: the whole cluster on this one node, as the local launcher runs it."""
    launcher = dataclasses.replace(cluster.launcher, kind="local", run_dir=str(run_dir))
    local = dataclasses.replace(cluster, launcher=launcher)
    local = prepare_launch(with_cluster_id(local, f"slurm-{env.run_name}"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "cluster.yaml"
    config_file.write_text(dump_config(local))
    workers, gateway = cluster_specs(local, config_file, run_dir)
    lc = LocalCluster(
        workers,
        gateway,
        launcher.ready_timeout_s,
        launcher.stop_grace_s,
        launcher.log_tail_lines,
        err=err,
    )
    with stop_on_signals(lc):
        try:
            lc.start()
        except LaunchError as exc:
            print(f"error: cluster did not start: {exc}", file=err, flush=True)
            return 1
        print(
            f"ready: http://{dial_address(local.gateway.host, local.gateway.port)} "
            "(single-node smoke, "
            f"run dir {run_dir})",
            file=out,
            flush=True,
        )
        try:
            if launcher.eval_on_ready:
                return run_gate(local, out, err)
            dead = lc.watch()
            return 0 if dead is None else 1
        finally:
            lc.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.launch.slurm nodes --config X.yaml [--set k=v]`: what
    submit.sh asks."""
    import argparse

    from orchestrator.config import ClusterConfigError, load_config

    p = argparse.ArgumentParser(prog="orchestrator.launch.slurm")
    p.add_argument("what", choices=["nodes", "artifact-dir", "partition", "time"])
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    try:
        cluster = load_config(resolve_config_path(args.config), args.overrides)
        if args.what == "nodes":  # submit.sh asks this first: refuse before sbatch
            check_time_limit(cluster.launcher.slurm_time_limit)
            if os.environ.get("PD_SLURM", "") == "1":  # workers dialed across nodes
                require_pinned(cluster, "slurm")
            for note in preflight(cluster):
                print(note, file=sys.stderr)
    except ClusterConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lc = cluster.launcher
    answer = {
        "nodes": str(num_nodes(cluster) if os.environ.get("PD_SLURM", "") == "1" else 1),
        "artifact-dir": str(Path(lc.artifact_dir).resolve()),
        "partition": lc.slurm_partition,
        "time": lc.slurm_time_limit,
    }[args.what]
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
