"""Child processes of a launcher: start them, wait until they are ready, watch, stop in order.

`LocalCluster` runs a set of worker processes and one gateway process, each in its own process
group with its log file; readiness is gRPC health SERVING (plus, where the spec names one, the
worker's identity in GetInfo) for workers and HTTP /health 200 for the gateway, under one
deadline. The local launcher (orchestrator/launch/local.py), the Slurm launcher (each node's
share) and the Ray launcher (its gateway) use it.
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

from orchestrator.config import REPO_ROOT
from orchestrator.launch.readiness import HealthWatch, http_ready, identity_problem
from protocol.identity import WorkerIdentity
from protocol.tls import TLSConfig

LAUNCHER_PID_ENV = "TANDEM_LAUNCHER_PID"  # set for a launched child: who must outlive it
EXIT_REFUSED = 2  # a child that refused its input (cli's EXIT_USAGE), its last line says why


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """A child's environment: `env` over ours, naming this process as its launcher."""
    return {**os.environ, **env, LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In a launched child: get SIGTERM (a drain) when the launcher dies, `kill -9` included,
    instead of living on as an orphan holding its port. Linux's PR_SET_PDEATHSIG, which
    survives the bind shim's exec; the variable is dropped so this child's own children
    (TP ranks) do not take its launcher for theirs. Linux sends the signal when the *thread*
    that started the child ends, so launchers spawn from their main thread (start() and
    watch()'s restarts run there in every launcher)."""
    pid = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != int(pid):  # it died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


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
    return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""  # [-0:] is every line


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
        env = launcher_env({"PYTHONUNBUFFERED": "1", **spec.env})  # TANDEM_* passes through
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

    def failed_to_start(self, child: Child) -> LaunchError:
        """A child that exited before it was ready. One that refused its input (exit 2, its
        last line `error: ...`: a checkpoint or config it cannot serve) is that line, no log
        tail around it; any other exit is reported with its log's tail."""
        code = child.proc.returncode
        last = tail(child.spec.log_path, 1)
        if code == EXIT_REFUSED and last.startswith("error: "):
            return LaunchError(f"{child.spec.name} refused to start: "
                               f"{last.removeprefix('error: ')} (log: {child.spec.log_path})")
        return self.report_failure(child, f"exited with code {code} before it was ready")

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
            raise self.failed_to_start(gw)
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
                raise self.failed_to_start(dead)
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

        With restarts left, a dead worker, or a gateway that crashed (non-zero exit), is started
        again (same command, same port) instead. A restarted gateway serves the config's
        workers; a worker that joined with --join is not among them until it joins again.
        """
        while not self._stop_requested:
            dead = self.dead_child()
            if dead is not None and dead in self._workers and dead.proc.returncode == 0:
                # Drained and exited on purpose (DELETE /workers, SIGTERM): it left.
                self._workers.remove(dead)
                self._left.append(dead)
                n = len(self._workers)
                print(
                    f"{dead.spec.name} drained and left the cluster (exit 0); serving on with "
                    f"{n} launched worker{'' if n == 1 else 's'}",
                    file=self.err,
                    flush=True,
                )
                continue
            crashed = dead is not None and (dead in self._workers or dead.proc.returncode != 0)
            if dead is not None and crashed and self.restarts_left > 0:
                self.restarts_left -= 1
                left = self.restarts_left
                print(
                    f"{dead.spec.name} exited with code {dead.proc.returncode}; restarting it "
                    f"({left} restart{'' if left == 1 else 's'} left)",
                    file=self.err,
                    flush=True,
                )
                dead.log.close()
                if dead is self._gateway:
                    self._gateway = self._spawn(dead.spec)
                else:
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
            if signal.getsignal(s) is handler:  # unless set inside (slurm_env.publish_stopped)
                signal.signal(s, h)
