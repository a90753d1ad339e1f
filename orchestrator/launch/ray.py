"""The Ray launcher: each worker replica in a placement group of its own, the gateway on the head.

Lifecycle (`tandem launch` with launcher.kind=ray, run on the head node):
  1. Connect: launcher.ray_address, or a local Ray instance when it is "" (tests, one box).
  2. Per replica, a placement group of one bundle holding all its ranks' resources
     (STRICT_PACK: a worker's GPUs are on one node; multi-node workers are Slurm's job), and
     one `WorkerHost` actor inside it. Ray sets CUDA_VISIBLE_DEVICES for the bundle, so the
     worker numbers its GPUs from cuda:0.
  3. Each actor reports its node's address; the replica's host becomes that address and the
     resolved config (YAML text: Ray nodes need not share a filesystem) goes to every actor,
     which starts `tandem worker` as a subprocess on its node, log in launcher.log_dir there.
  4. From the head: wait until every worker's gRPC health says SERVING (a dead worker's log
     tail comes back from its actor), start the gateway as a local process, wait for /health.
  5. With launcher.eval_on_ready: run the eval gate, then stop and return its status. Else serve
     until SIGINT/SIGTERM or a worker's exit.
  6. Stop: the gateway, then every actor's worker (SIGTERM, SIGKILL after the grace), then
     the placement groups; a local Ray instance is shut down. Once it was ready it prints what
     it stopped, with exit codes, as the local launcher does (`stopped: lb (0), ...`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import REPO_ROOT, ClusterConfig, dial_address, dump_config
from orchestrator.launch.describe import stopped_line
from orchestrator.launch.local import (
    cluster_specs,
    expected_identity,
    run_dir_of,
    with_cluster_id,
)
from orchestrator.launch.ports import check_ports, require_pinned
from orchestrator.launch.processes import LaunchError, LocalCluster, stop_on_signals
from orchestrator.launch.readiness import HealthWatch, identity_problem
from orchestrator.launch.run_dir import RunDir
from orchestrator.launch.slurm import run_gate
from orchestrator.plan import preflight
from orchestrator.rank_map import procs_per_node
from protocol.tls import TLSConfig


# max_concurrency: wait() blocks one thread, stop() and tail() must still run (ray's stubs
# lack the actor-only option, hence the ignore).
@ray.remote(num_cpus=0, max_concurrency=4)  # type: ignore[call-overload]
class WorkerHost:
    """Runs one `tandem worker` subprocess on the node Ray placed this actor on."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name = name
        self.log_path = Path(log_dir).resolve() / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def node_address(self) -> str:
        return str(ray.util.get_node_ip_address())

    def start(self, config_yaml: str, role: str, replica: int) -> int:
        """Write the config on this node, start the worker; returns its pid."""
        # Beside its log, owner-only (it holds the api and admin keys): the temporary directory
        # it went to before was never removed.
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        config_file = self.log_path.with_name(f"{self.name}.cluster.yaml")
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(config_yaml)
        config_file.chmod(0o600)  # one left by an earlier run with other bits
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orchestrator.cli",
                    "worker",
                    "--config",
                    str(config_file),
                    "--role",
                    role,
                    "--replica",
                    str(replica),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        return self.proc.pid

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the worker exits within timeout_s, else None."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""  # [-0:]: every line

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the worker's process group, SIGKILL after grace_s; returns its exit code."""
        if self.proc is None:
            return None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.wait()


@dataclasses.dataclass
class _Replica:
    role: str
    replica: int
    name: str
    pg: Any  # ray PlacementGroup
    actor: Any  # WorkerHost handle
    address: str = ""  # host:port its gRPC server listens on


def bundle(cluster: ClusterConfig, role: str) -> dict[str, float]:
    """One replica's resources: a CPU for its entry process, a GPU per rank on cuda."""
    rc = cluster.role(role)
    res: dict[str, float] = {"CPU": 1.0}
    if rc.parallel.device.startswith("cuda"):
        res["GPU"] = float(procs_per_node(rc))
    return res


def _connect(cluster: ClusterConfig) -> bool:
    """ray.init; True when we started a local instance (and so must shut it down)."""
    address = cluster.launcher.ray_address
    env = {"PYTHONPATH": str(REPO_ROOT)}  # actors import orchestrator.* on every node
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
        return False
    # A local instance for one machine: loopback only, no dashboard, no token (nothing else
    # can reach it); see shared notes on Ray's defaults.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    return True


def _place(cluster: ClusterConfig, timeout_s: float) -> list[_Replica]:
    # A bundle no node could ever hold stays pending forever: refuse it now, not at the deadline.
    have = ray.cluster_resources()
    for role, _ in cluster.roles.present():
        for res, amount in bundle(cluster, role).items():
            if have.get(res, 0.0) < amount:
                raise LaunchError(
                    f"roles.{role} needs {amount:g} {res} per replica but the Ray cluster has "
                    f"{have.get(res, 0.0):g}; add nodes with {res} or change roles.{role}.parallel"
                )
    out: list[_Replica] = []
    for role, rc in cluster.roles.present():
        for i in range(rc.count):
            pg = placement_group(
                [bundle(cluster, role)], strategy="STRICT_PACK", name=f"tandem-{role}-{i}"
            )
            name = f"{role}-{i}"
            actor = WorkerHost.options(  # type: ignore[attr-defined]
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0
                ),
            # Resolved here: a relative log_dir is the launcher's, not the directory that
            # `ray start` ran in (the actors' working directory).
            ).remote(name, str(run_dir_of(cluster).resolve()))
            out.append(_Replica(role, i, name, pg, actor))
    for r in out:
        ready, _ = ray.wait([r.pg.ready()], timeout=timeout_s)
        if not ready:
            raise LaunchError(
                f"placement group of {r.name} ({bundle(cluster, r.role)}) was not placed within "
                f"{timeout_s:g} s: the Ray cluster lacks the resources; check `ray status`"
            )
    return out


def _resolve(cluster: ClusterConfig, replicas: list[_Replica]) -> ClusterConfig:
    """Each replica's host = its actor's node address; cuda roles count GPUs from 0 (Ray's
    CUDA_VISIBLE_DEVICES holds only the bundle's)."""
    nodes = ray.get([r.actor.node_address.remote() for r in replicas])
    roles = cluster.roles
    for name, rc in roles.present():
        hosts = tuple(n for r, n in zip(replicas, nodes, strict=True) if r.role == name)
        par = rc.parallel
        if par.device.startswith("cuda"):
            par = dataclasses.replace(par, device="cuda:0")
        roles = dataclasses.replace(
            roles, **{name: dataclasses.replace(rc, hosts=hosts, parallel=par)}
        )
    resolved = dataclasses.replace(cluster, roles=roles)
    for r in replicas:
        rc = resolved.role(r.role)
        r.address = dial_address(rc.host_of(r.replica), rc.port(r.replica))
    return resolved


def _wait_serving(
    cluster: ClusterConfig,
    replicas: list[_Replica],
    deadline: float,
    tail_lines: int,
    err: IO[str],
    tls: TLSConfig,
) -> None:
    wake = threading.Event()
    watches = [HealthWatch(r.address, wake, tls) for r in replicas]
    exits = {r.name: r.actor.wait.remote(max(0.1, deadline - time.monotonic())) for r in replicas}
    try:
        for w in watches:
            w.start(max(0.1, deadline - time.monotonic()))
        while not all(w.ready.is_set() for w in watches):
            done, _ = ray.wait(list(exits.values()), timeout=0.2)
            for r in replicas:
                if exits[r.name] in done and (code := ray.get(exits[r.name])) is not None:
                    print(
                        f"--- last lines of {r.name}.log ---\n"
                        f"{ray.get(r.actor.tail.remote(tail_lines))}",
                        file=err,
                    )
                    raise LaunchError(f"{r.name} exited with code {code} before it was ready")
            if time.monotonic() > deadline:
                late = [
                    r.name for r, w in zip(replicas, watches, strict=True) if not w.ready.is_set()
                ]
                raise LaunchError(f"not SERVING before launcher.ready_timeout_s: {', '.join(late)}")
    finally:
        for w in watches:
            w.close()
    for r in replicas:  # SERVING is not enough: it must be the worker this launch started
        problem = identity_problem(r.address, expected_identity(cluster, r.role, r.replica), tls)
        if problem:
            raise LaunchError(problem)


def run_ray(cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the cluster on Ray in the foreground; returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    require_pinned(cluster, "ray")
    for note in preflight(cluster):  # the checkpoint and the layout: one line, before Ray
        print(note, file=err, flush=True)
    # The gateway runs here: a taken port is one line now, not after the workers have loaded.
    check_ports(cluster, lambda ln: ln.who == "gateway")
    cluster = with_cluster_id(cluster)
    held = RunDir(run_dir_of(cluster))
    run_dir = held.path
    launcher, t0 = cluster.launcher, time.monotonic()
    deadline = t0 + launcher.ready_timeout_s
    local = _connect(cluster)
    replicas: list[_Replica] = []
    gateway: LocalCluster | None = None
    stopped: list[str] = []  # `name (exit code)` of what the shutdown stopped, in order
    ready = False  # the ready line was printed: the stopped line follows it
    try:
        replicas = _place(cluster, launcher.ready_timeout_s)
        resolved = _resolve(cluster, replicas)
        text = dump_config(resolved)
        ray.get([r.actor.start.remote(text, r.role, r.replica) for r in replicas])
        _wait_serving(resolved, replicas, deadline, launcher.log_tail_lines, err, cluster.tls)
        config_file = (run_dir / "cluster.yaml").resolve()
        config_file.write_text(text)
        config_file.chmod(0o600)  # it holds the api and admin keys
        _, gw_spec = cluster_specs(resolved, config_file, run_dir)
        gateway = LocalCluster(
            [],
            gw_spec,
            max(1.0, deadline - time.monotonic()),
            launcher.stop_grace_s,
            launcher.log_tail_lines,
            err=err,
        )
        with stop_on_signals(gateway):
            gateway.start()
            ready = True
            gw = cluster.gateway
            print(
                f"[{time.monotonic() - t0:6.1f}s] ready: http://{dial_address(gw.host, gw.port)} "
                f"({len(replicas)} workers on Ray; cluster {launcher.cluster_id}; logs {run_dir})",
                file=out,
                flush=True,
            )
            if launcher.eval_on_ready:
                code = run_gate(cluster, out, err)
                print(
                    f"[{time.monotonic() - t0:6.1f}s] gate done: exit {code}", file=out, flush=True
                )
                return code
            return _serve(gateway, replicas, err, launcher.log_tail_lines)
    except LaunchError as exc:
        print(f"error: cluster did not start: {exc}", file=err, flush=True)
        return 1
    finally:
        if gateway is not None:
            stopped += gateway.stop()
        stopped += _teardown(replicas, launcher.stop_grace_s)
        if local:
            ray.shutdown()
        if ready:  # as the local launcher: what it stopped, with exit codes
            print(stopped_line(stopped, run_dir), file=out, flush=True)
        held.close()


def _serve(gateway: LocalCluster, replicas: list[_Replica], err: IO[str], tail_lines: int) -> int:
    """Until SIGINT/SIGTERM (0), the gateway's exit or a worker's exit (1)."""
    exits = {r.actor.wait.remote(1e9): r for r in replicas}
    while not gateway.stop_requested:
        done, _ = ray.wait(list(exits), timeout=0.5)
        if done:
            r = exits[done[0]]
            print(
                f"{r.name} exited with code {ray.get(done[0])}; last lines:\n"
                f"{ray.get(r.actor.tail.remote(tail_lines))}",
                file=err,
            )
            return 1
        if gateway.dead_child() is not None:
            print("the gateway exited", file=err)
            return 1
    return 0


def _teardown(replicas: list[_Replica], grace_s: float) -> list[str]:
    """Stop every replica's worker (SIGTERM: it drains), then its actor and placement group;
    returns `name (exit code)` of each worker that was started."""
    codes = ray.get([r.actor.stop.remote(grace_s) for r in replicas]) if replicas else []
    for r in replicas:
        ray.kill(r.actor)
        remove_placement_group(r.pg)
    return [f"{r.name} ({code})" for r, code in zip(replicas, codes, strict=True)
            if code is not None]
