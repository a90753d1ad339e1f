"""A child of `tandem serve` ends when the launcher dies, `kill -9` included: before, its
workers and gateway lived on as orphans, still holding the ports, and `ps | grep tandem` did
not show them (they run as `python -m orchestrator.cli`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

# The launcher: starts one child the way LocalCluster does, prints its pid, waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from orchestrator.launch.processes import launcher_env
    child = subprocess.Popen([sys.executable, "-c",
        "from orchestrator.launch.processes import die_with_launcher; import os, time; "
        "die_with_launcher(); print(os.environ.get('TANDEM_LAUNCHER_PID'), flush=True); "
        "time.sleep(60)"], env=launcher_env({}), stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_launched_child_ends_when_the_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert launcher.stdout is not None
    pid, seen = launcher.stdout.readline().split()
    child = int(pid)
    try:
        assert seen == "None", "the child drops the variable: its own children must not see it"
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        end = time.monotonic() + 5.0
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived its launcher"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
