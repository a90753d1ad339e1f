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
  6. Print `ready: http://HOST:PORT (model, workers, transfer, cluster id, run dir)` and watch:
     a worker that exits 0 has drained and left (DELETE /workers, or SIGTERM): the cluster
     serves on with the others; another exit ends the cluster with a non-zero status naming
     it (or restarts it, on_worker_exit: restart); SIGINT/SIGTERM end it cleanly.
  7. Ordered shutdown: the gateway first (no new requests), then the workers; SIGTERM (a
     worker drains, holding nothing by then), SIGKILL after launcher.stop_grace_s; prints what
     it stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from orchestrator.config import REPO_ROOT, ClusterConfig, dial_address, dump_config
from orchestrator.launch.ports import check_ports, resolve_ports
from orchestrator.launch.readiness import HealthWatch, http_ready, identity_problem
from orchestrator.plan import plan_processes, read_model_config
from protocol.identity import WorkerIdentity, model_fingerprint
from protocol.tls import TLSConfig


class LaunchError(RuntimeError):
    """The cluster could not start or a process died; the message names the process."""


@dataclass(frozen=True)
class ProcessSpec:
    """One child process: how to start it and how it signals readiness."""

    name: str  # prefill-0, decode-0, lb
    argv: list[str]
    log_path: Path
    grpc_address: str = ""  # readiness = grpc.health.v1 SERVING at this host:port
    health_url: str = ""  # readiness = HTTP 200 here (the gateway)
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    tls: TLSConfig = field(default_factory=TLSConfig)  # how readiness checks dial grpc_address
    # Who must answer at grpc_address (GetInfo) before the worker counts as ready; None = any.
    identity: WorkerIdentity | None = None


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


def tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalCluster:
    """Starts, watches and stops a set of worker processes and one gateway process."""

    def __init__(
        self,
        workers: list[ProcessSpec],
        gateway: ProcessSpec | None,
        ready_timeout_s: float,
        stop_grace_s: float,
        log_tail_lines: int = 40,
        err: IO[str] | None = None,
        restart_workers: int = 0,
    ) -> None:
        self.worker_specs = workers
        self.gateway_spec = gateway
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_tail_lines = log_tail_lines
        self.err = err or sys.stderr
        self.restarts_left = restart_workers  # restarts of dead workers before giving up
        self._wake = threading.Event()  # any child exit, health change or stop request
        self._stop_requested = False
        self._workers: list[Child] = []
        self._left: list[Child] = []  # workers that drained and exited 0 (they left on purpose)
        self._gateway: Child | None = None

    # -- control ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask start()/watch() to return; safe from a signal handler."""
        self._stop_requested = True
        self._wake.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def _spawn(self, spec: ProcessSpec) -> Child:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_path, "ab")  # noqa: SIM115  (closed in stop())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}  # TANDEM_* passes through
        paths = (str(REPO_ROOT), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        # start_new_session: its own process group, so Ctrl-C in the terminal reaches only us
        # and we stop the children in order; killpg also reaches anything the child spawned.
        proc = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        child = Child(spec, proc, log)
        threading.Thread(
            target=self._reap, args=(proc,), name=f"wait-{spec.name}", daemon=True
        ).start()
        return child

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self._wake.set()

    def report_failure(self, child: Child, what: str) -> LaunchError:
        text = tail(child.spec.log_path, self.log_tail_lines)
        print(
            f"error: {child.spec.name} {what}; last lines of {child.spec.log_path}:", file=self.err
        )
        print(text or "(log is empty)", file=self.err)
        return LaunchError(f"{child.spec.name} {what} (log: {child.spec.log_path})")

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start workers, wait for SERVING, start the gateway, wait for /health 200.

        Raises LaunchError (after stopping everything) on a timeout or an early exit.
        Returns early, with nothing left running, if request_stop() is called meanwhile.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        self._workers = [self._spawn(spec) for spec in self.worker_specs]
        watches = [HealthWatch(c.spec.grpc_address, self._wake, c.spec.tls) for c in self._workers]
        try:
            for w in watches:
                w.start(self.ready_timeout_s)
            self._wait_workers(watches, deadline)
        finally:
            for w in watches:
                w.close()
        if self._stop_requested or self.gateway_spec is None:
            return
        self._gateway = self._spawn(self.gateway_spec)
        gw = self._gateway
        ok = http_ready(
            gw.spec.health_url,
            deadline,
            keep_waiting=lambda: gw.proc.poll() is None and not self._stop_requested,
            interrupt=self._wake,
        )
        if self._stop_requested:
            return
        if gw.proc.poll() is not None:
            raise self.report_failure(
                gw, f"exited with code {gw.proc.returncode} before it was ready"
            )
        if not ok:
            raise self.report_failure(
                gw, f"did not answer 200 on {gw.spec.health_url} within {self.ready_timeout_s:g} s"
            )
        dead = self.dead_child()
        if dead is not None:
            raise self.report_failure(dead, f"exited with code {dead.proc.returncode}")

    def _wait_workers(self, watches: list[HealthWatch], deadline: float) -> None:
        checked: set[int] = set()  # indices whose identity was accepted
        while not self._stop_requested:
            dead = self.dead_child()
            if dead is not None:
                raise self.report_failure(
                    dead, f"exited with code {dead.proc.returncode} before it was ready"
                )
            for i, (c, w) in enumerate(zip(self._workers, watches, strict=True)):
                if w.ready.is_set() and i not in checked:
                    self._check_identity(c)
                    checked.add(i)
            pending = [
                (c, w) for c, w in zip(self._workers, watches, strict=True) if not w.ready.is_set()
            ]
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                child, watch = pending[0]
                names = ", ".join(c.spec.name for c, _ in pending)
                raise self.report_failure(
                    child,
                    f"was not SERVING on {watch.address} within {self.ready_timeout_s:g} s "
                    f"(last health: {watch.last_status}; not ready: {names})",
                )
            self._wake.wait(remaining)
            self._wake.clear()

    def _check_identity(self, child: Child) -> None:
        """SERVING at the address is not enough: it must be the worker this launch started."""
        spec = child.spec
        if spec.identity is None:
            return
        problem = identity_problem(spec.grpc_address, spec.identity, spec.tls)
        if problem:
            raise LaunchError(problem)

    # -- run -------------------------------------------------------------------------------
    def children(self) -> list[Child]:
        return self._workers + self._left + ([self._gateway] if self._gateway else [])

    def dead_child(self) -> Child | None:
        live = self._workers + ([self._gateway] if self._gateway else [])
        return next((c for c in live if c.proc.poll() is not None), None)

    def watch(self) -> Child | None:
        """Block until a stop request (None) or a child's exit (that child).

        With restarts left, a dead worker is started again (same command, same port) instead.
        """
        while not self._stop_requested:
            dead = self.dead_child()
            if dead is not None and dead in self._workers and dead.proc.returncode == 0:
                # Drained and exited on purpose (DELETE /workers, SIGTERM): it left.
                self._workers.remove(dead)
                self._left.append(dead)
                print(
                    f"{dead.spec.name} drained and left the cluster (exit 0); serving on with "
                    f"{len(self._workers)} launched workers",
                    file=self.err,
                    flush=True,
                )
                continue
            if dead is not None and dead in self._workers and self.restarts_left > 0:
                self.restarts_left -= 1
                print(
                    f"{dead.spec.name} exited with code {dead.proc.returncode}; restarting it "
                    f"({self.restarts_left} restarts left)",
                    file=self.err,
                    flush=True,
                )
                dead.log.close()
                self._workers[self._workers.index(dead)] = self._spawn(dead.spec)
                continue
            if dead is not None:
                return dead
            self._wake.wait()
            self._wake.clear()
        return None

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Gateway first, then the workers: SIGTERM, SIGKILL after the grace period.

        Returns `name (exit code)` of every process it stopped, in order."""
        stopped = []
        if self._gateway is not None:
            stopped += self._terminate([self._gateway])
        stopped += self._terminate(self._workers)
        for c in self.children():
            c.log.close()
        return stopped

    def _terminate(self, children: list[Child]) -> list[str]:
        live = [c for c in children if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"{c.spec.name} ignored SIGTERM for {self.stop_grace_s:g} s; killing it",
                    file=self.err,
                )
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()
        for c in children:
            # Leftovers of the group (grandchildren) whose leader already exited.
            _signal_group(c.proc, signal.SIGKILL)
        return [f"{c.spec.name} ({c.proc.returncode})" for c in live]


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # pid == pgid: start_new_session made it the group leader. Lookup error: the group is gone.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


@contextmanager
def stop_on_signals(cluster: LocalCluster) -> Iterator[None]:
    """SIGINT / SIGTERM → cluster.request_stop() while inside (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = lambda signum, frame: cluster.request_stop()  # noqa: E731
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_dir_of(cluster: ClusterConfig) -> Path:
    """The cluster's own directory: launcher.run_dir, else <log_dir>/<gateway port>."""
    launcher = cluster.launcher
    return Path(launcher.run_dir or Path(launcher.log_dir) / str(cluster.gateway.port))


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty run directory; the previous run's files move to `<run_dir>.prev`."""
    if run_dir.exists():
        prev = run_dir.with_name(run_dir.name + ".prev")
        shutil.rmtree(prev, ignore_errors=True)
        run_dir.rename(prev)
    run_dir.mkdir(parents=True)
    return run_dir


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
    read_model_config(cluster.model.path)  # a missing checkpoint: one line, not a log tail
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


def ready_line(cluster: ClusterConfig, workers: list[ProcessSpec], run_dir: Path) -> str:
    """`ready: URL (model M; workers prefill-0, decode-0 (2 ranks); mooncake; cluster C;
    logs D)`: what a user needs to start using it and to find its logs."""
    gw = cluster.gateway
    names = []
    for spec in workers:
        role = cluster.role(spec.name.rsplit("-", 1)[0])
        ranks = role.parallel.world_size
        names.append(spec.name + (f" ({ranks} ranks)" if ranks > 1 else ""))
    transfer = cluster.transfer.backend if cluster.roles.is_pd else "mono"
    return (
        f"ready: http://{dial_address(gw.host, gw.port)} (model {cluster.served_model_name}; "
        f"workers {', '.join(names)}; {transfer}; cluster {cluster.launcher.cluster_id}; "
        f"logs {run_dir})"
    )


def run_local(
    cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    """Run the cluster in the foreground until Ctrl-C / SIGTERM (0) or a child's death (1)."""
    out, err = out or sys.stdout, err or sys.stderr
    cluster = prepare_launch(cluster)
    run_dir = fresh_run_dir(run_dir_of(cluster))
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
        if lc.stop_requested:
            lc.stop()
            return 0
        print(ready_line(cluster, workers, run_dir), file=out, flush=True)
        dead = lc.watch()
        code = 0
        if dead is not None:
            lc.report_failure(dead, f"exited unexpectedly with code {dead.proc.returncode}")
            code = 1
        stopped = lc.stop()
    print(
        f"stopped: {', '.join(stopped) or 'nothing was running'}; logs in {run_dir}",
        file=out,
        flush=True,
    )
    return code
