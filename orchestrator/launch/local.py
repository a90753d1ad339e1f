"""The local launcher: the whole cluster as subprocesses of this machine.

Lifecycle:
  1. Write the resolved config to `<log_dir>/cluster.yaml`; every child reads that one file,
     so flags given to `tandem serve` (--model, --port, --set) reach every process.
  2. Start every worker (`python -m orchestrator.cli worker --role R --replica I`) in its own
     process group, stdout+stderr to `<log_dir>/<role>-<i>.log`.
  3. Wait until each worker's gRPC health says SERVING, up to launcher.ready_timeout_s. On
     timeout or an early exit: stop everything, print the failed process's log tail, fail.
  4. Start the gateway (`lb.log`), wait for HTTP /health 200 within the same deadline.
  5. Print `ready: http://HOST:PORT (model; workers, ranks, devices; transfer; logs)`
     (orchestrator/launch/describe.py) and watch: a child that exits ends the
     cluster with a non-zero status naming it; SIGINT/SIGTERM end it cleanly.
  6. Ordered shutdown: the gateway first (no new requests), then the workers; SIGTERM, then
     SIGKILL after launcher.stop_grace_s; print `stopped:` with what was running.
"""

from __future__ import annotations

import contextlib
import os
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

from orchestrator.checkpoint import preflight
from orchestrator.config import REPO_ROOT, ClusterConfig, dial_address, dump_config
from orchestrator.launch.describe import ready_line, stopped_line
from orchestrator.launch.readiness import HealthWatch, http_ready
from orchestrator.plan import plan_processes
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
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        # start_new_session: its own process group, so Ctrl-C in the terminal reaches only us
        # and we stop the children in order; killpg also reaches anything the child spawned.
        proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        child = Child(spec, proc, log)
        threading.Thread(target=self._reap, args=(proc,), name=f"wait-{spec.name}", daemon=True).start()
        return child

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self._wake.set()

    def report_failure(self, child: Child, what: str) -> LaunchError:
        text = tail(child.spec.log_path, self.log_tail_lines)
        print(f"error: {child.spec.name} {what}; last lines of {child.spec.log_path}:", file=self.err)
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
        ok = http_ready(gw.spec.health_url, deadline,
                        keep_waiting=lambda: gw.proc.poll() is None and not self._stop_requested,
                        interrupt=self._wake)
        if self._stop_requested:
            return
        if gw.proc.poll() is not None:
            raise self.report_failure(gw, f"exited with code {gw.proc.returncode} before it was ready")
        if not ok:
            raise self.report_failure(gw, f"did not answer 200 on {gw.spec.health_url} within {self.ready_timeout_s:g} s")
        dead = self.dead_child()
        if dead is not None:
            raise self.report_failure(dead, f"exited with code {dead.proc.returncode}")

    def _wait_workers(self, watches: list[HealthWatch], deadline: float) -> None:
        while not self._stop_requested:
            dead = self.dead_child()
            if dead is not None:
                raise self.report_failure(dead, f"exited with code {dead.proc.returncode} before it was ready")
            pending = [(c, w) for c, w in zip(self._workers, watches, strict=True) if not w.ready.is_set()]
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

    # -- run -------------------------------------------------------------------------------
    def children(self) -> list[Child]:
        return self._workers + ([self._gateway] if self._gateway else [])

    def dead_child(self) -> Child | None:
        return next((c for c in self.children() if c.proc.poll() is not None), None)

    def watch(self) -> Child | None:
        """Block until a stop request (None) or a child's exit (that child).

        With restarts left, a dead worker is started again (same command, same port) instead.
        """
        while not self._stop_requested:
            dead = self.dead_child()
            if dead is not None and dead in self._workers and self.restarts_left > 0:
                self.restarts_left -= 1
                print(f"{dead.spec.name} exited with code {dead.proc.returncode}; restarting it "
                      f"({self.restarts_left} restarts left)", file=self.err, flush=True)
                dead.log.close()
                self._workers[self._workers.index(dead)] = self._spawn(dead.spec)
                continue
            if dead is not None:
                return dead
            self._wake.wait()
            self._wake.clear()
        return None

    # -- stop ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Gateway first, then the workers: SIGTERM, SIGKILL after the grace period."""
        if self._gateway is not None:
            self._terminate([self._gateway])
        self._terminate(self._workers)
        for c in self.children():
            c.log.close()

    def _terminate(self, children: list[Child]) -> None:
        live = [c for c in children if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{c.spec.name} ignored SIGTERM for {self.stop_grace_s:g} s; killing it", file=self.err)
                _signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()
        for c in children:
            # Leftovers of the group (grandchildren) whose leader already exited.
            _signal_group(c.proc, signal.SIGKILL)


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


def cluster_specs(cluster: ClusterConfig, config_file: Path) -> tuple[list[ProcessSpec], ProcessSpec]:
    """Worker and gateway process specs for a resolved config file written at `config_file`."""
    log_dir = Path(cluster.launcher.log_dir)
    base = [sys.executable, "-m", "orchestrator.cli"]
    workers = [
        ProcessSpec(
            name=row.name,
            argv=[*base, "worker", "--config", str(config_file), "--role", row.role, "--replica", str(row.replica)],
            log_path=log_dir / f"{row.name}.log",
            grpc_address=dial_address(row.host, row.port),
            tls=cluster.tls,
        )
        for row in plan_processes(cluster)
        if row.role != "gateway" and row.starts_node  # a worker starts its node's other ranks itself
    ]
    gw = cluster.gateway
    gateway = ProcessSpec(
        name="lb",
        argv=[*base, "gateway", "--config", str(config_file)],
        log_path=log_dir / "lb.log",
        health_url=f"http://{dial_address(gw.host, gw.port)}/health",
    )
    return workers, gateway


def run_local(cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the cluster in the foreground until Ctrl-C / SIGTERM (0) or a child's death (1)."""
    out, err = out or sys.stdout, err or sys.stderr
    # Fail before anything starts when the checkpoint or the layout is wrong (one line naming
    # the file and field), instead of after a worker's start-up and a log tail.
    for note in preflight(cluster):
        print(note, file=out, flush=True)
    log_dir = Path(cluster.launcher.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config_file = (log_dir / "cluster.yaml").resolve()
    config_file.write_text(dump_config(cluster))
    workers, gateway = cluster_specs(cluster, config_file)
    launcher = cluster.launcher
    restarts = launcher.max_restarts if launcher.on_worker_exit == "restart" else 0
    lc = LocalCluster(workers, gateway, launcher.ready_timeout_s, launcher.stop_grace_s,
                      launcher.log_tail_lines, err=err, restart_workers=restarts)
    with stop_on_signals(lc):
        try:
            lc.start()
        except LaunchError as exc:
            print(f"error: cluster did not start: {exc}", file=err)
            return 1
        if lc.stop_requested:
            lc.stop()
            return 0
        print(ready_line(cluster, log_dir), file=out, flush=True)
        dead = lc.watch()
        code = 0
        if dead is not None:
            lc.report_failure(dead, f"exited unexpectedly with code {dead.proc.returncode}")
            code = 1
        running = [c.spec.name for c in (lc.children()[-1:] + lc.children()[:-1])
                   if c.proc.poll() is None]  # the order stop() takes: the gateway first
        lc.stop()
    print(stopped_line(running, log_dir), file=out, flush=True)
    return code
