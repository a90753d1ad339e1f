"""Suite-wide: no listener of ours survives a test module.

Every process the test session starts inherits `TANDEM_TEST_SESSION=<this session>` (set
before any test runs). After each module, a process that still carries it and still listens
on a TCP port is a leak (a cluster, worker or gateway a test did not stop): the module fails
naming it, and the process is ended by its pid so the next module starts clean. Fixtures that
own long-lived infrastructure for the whole session (the local Slurm cluster) start it
without the marker and stop it themselves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.chaos import report as chaos_report
from tests.listeners import Listener, listeners, marked

SESSION_ENV = "TANDEM_TEST_SESSION"
# Torch in the test processes (and the ranks and workers they spawn) runs one OpenMP thread
# unless a test asks for more: `make test` runs two xdist processes on a two-core box, and two
# pools of two spinning OpenMP threads each cost the in-process model tests ~30% of their time.
# Cluster workers set their own count from the config (roles.*.num_threads).
THREADS_ENV = {"OMP_NUM_THREADS": "1"}
_GRACE_S = 10.0  # a process asked to stop at the module's end may take this long to go


def pytest_configure(config: pytest.Config) -> None:
    os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # Before any test module loads torch (xdist's processes inherit it from the controller).
    for name, value in THREADS_ENV.items():
        os.environ.setdefault(name, value)  # a count set by hand wins


def ours_listening() -> list[Listener]:
    """Listeners of this session's processes, this pytest process aside (in-process servers
    of a module are its fixtures' business)."""
    pids = [p for p in marked(SESSION_ENV, os.environ[SESSION_ENV]) if p != os.getpid()]
    return listeners(pids)


def without_session_marker() -> dict[str, str]:
    """The environment for session-wide infrastructure that outlives a module."""
    return {k: v for k, v in os.environ.items() if k != SESSION_ENV}


@pytest.fixture(autouse=True, scope="module")
def no_listener_survives_the_module() -> Iterator[None]:
    yield
    deadline = time.monotonic() + _GRACE_S
    left = ours_listening()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ours_listening()
    if left:
        for pid in sorted({ln.pid for ln in left}):
            with contextlib.suppress(ProcessLookupError):  # it went away meanwhile
                os.kill(pid, signal.SIGKILL)
        pytest.fail(
            "listeners of this test session survived the module: "
            + "; ".join(str(ln) for ln in left),
            pytrace=False,
        )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with `slow` tests first, each module's items kept together and in order.

    `make test` hands whole modules to its xdist processes in this order
    (--no-loadscope-reorder; xdist's own order, by number of tests, put the one-test cluster
    modules of a minute each last, so one process ran them while the other sat idle). With
    the long modules first, the many short ones even out the end."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow = {module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: module(item) not in slow)  # stable: order within kept


# The chaos drills' table (tests/e2e/chaos/report.py): here, because every process of a run
# loads this conftest, an xdist controller too.
def pytest_sessionfinish(session: pytest.Session) -> None:
    chaos_report.session_finished(session)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    chaos_report.node_down(node, error)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    chaos_report.terminal_summary(terminalreporter)
