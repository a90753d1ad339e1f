"""Ctrl-C in `tandem bench` and `tandem eval`: one line saying what was done, exit 130.

The commands run as programs (SIGINT is what a terminal's Ctrl-C sends) against the OpenAI
server double, slowed so that a run is still going when the signal arrives; the signal is sent
once the double has seen requests (a state, not a sleep).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble

ROOT = Path(__file__).resolve().parents[2]


def _interrupt(argv: list[str], state: DoubleState, seen: int) -> tuple[int, str, str]:
    """Start `tandem ARGV`, SIGINT it once the double has had `seen` requests; (rc, out, err)."""
    # Its own process group, signalled whole, as a terminal does (load-generator processes too).
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def seen_enough() -> None:
        deadline = time.monotonic() + 60
        while len(state.requests) < seen and proc.poll() is None:
            assert time.monotonic() < deadline, "the command sent no requests"
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()

    out, err = _ctrl_c(proc, seen_enough)
    return proc.returncode, out, err


def _ctrl_c(proc: subprocess.Popen[str], ready: Callable[[], None]) -> tuple[str, str]:
    """Once `ready()` returns, SIGINT `proc`'s process group (as a terminal's Ctrl-C reaches
    it); its (stdout, stderr). Killed if it is still running after."""
    try:
        ready()
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("clients", ["1", "2"])
def test_ctrl_c_in_bench_is_one_line_with_what_was_done(clients: str) -> None:
    state = DoubleState(token_delay_s=0.05)  # 40 tokens: 2 s a request, 200 requests
    with OpenAIDouble(state) as url:
        rc, out, err = _interrupt(
            ["bench", "--url", url, "--concurrency", "2", "--num-requests", "200",
             "--output-len", "40", "--input-len", "8", "--clients", clients], state, 2)
    assert "Traceback" not in err, err
    assert rc == 130
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: load point 1 of 1 (concurrency 2)"), err
    assert "200 requests" in last and "nothing written" not in last


def test_ctrl_c_in_a_sweep_prints_the_points_it_finished(tmp_path: Path) -> None:
    state = DoubleState()

    def slow_after_the_first_point(i: int, prompt: object) -> str:
        # The first point (c=1, 4 requests) is quick; from the second's first request on, the
        # double streams slowly, so the signal lands inside point 2.
        if i >= 4:
            state.token_delay_s = 0.05
        return "right"

    state.rule = slow_after_the_first_point
    with OpenAIDouble(state) as url:
        rc, out, err = _interrupt(
            ["bench", "--url", url, "--concurrency", "1,2", "--num-requests", "4",
             "--output-len", "40", "--input-len", "8", "--out", str(tmp_path / "o")], state, 6)
    assert "Traceback" not in err, err
    assert rc == 130
    assert "concurrency 1" in out and "concurrency 2" not in out  # the finished point's table
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: load point 2 of 2 (concurrency 2)"), err
    assert "nothing written to" in last and not (tmp_path / "o").exists()


def test_ctrl_c_in_eval_is_one_line_with_the_score_so_far() -> None:
    problems = arith.make_problems(300, 7)
    state = DoubleState(answers={p.prompt: p.answer for p in problems}, token_delay_s=0.2)
    with OpenAIDouble(state) as url:
        rc, out, err = _interrupt(
            ["eval", "--url", url, "--task", "arith", "--samples", "300", "--seed", "7",
             "--concurrency", "2"], state, 4)
    assert "Traceback" not in err, err
    assert rc == 130
    assert "accuracy" not in out  # no verdict on a part of the problems
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: "), err
    assert "of 300 problems answered" in last and "no verdict" in last


def test_ctrl_c_in_bench_config_is_one_line() -> None:
    """`bench --config` (the engine in this process, then a cluster it starts): SIGINT during
    the engine's run ends it in one line, with no table and nothing left running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--config", "configs/tiny-mono.yaml",
         "--concurrency", "4", "--num-requests", "100000", "--input-len", "16",
         "--output-len", "8"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)

    def engine_started() -> None:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # printed as the engine starts
        assert first.startswith("[bench] engine in-process, B=4"), first

    out, err = _ctrl_c(proc, engine_started)
    assert "Traceback" not in err, err
    assert proc.returncode == 130 and out == ""
    assert err.strip().splitlines()[-1].startswith("interrupted: served / engine"), err


_SIGINT_AT_IMPORT = """
import builtins, os, signal, sys
from orchestrator.cli import main
real = builtins.__import__
def hooked(name, *args, **kwargs):  # a real SIGINT, delivered as the command loads its module
    if name == sys.argv[1]:
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = hooked
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(("module", "command"), [("orchestrator.bench", "bench"),
                                                 ("orchestrator.eval", "eval")])
def test_ctrl_c_while_the_command_loads_is_one_line(module: str, command: str) -> None:
    out = subprocess.run([sys.executable, "-c", _SIGINT_AT_IMPORT, module, command, "--url",
                          "http://127.0.0.1:9"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 130
    assert out.stderr.strip() == f"interrupted: tandem {command} stopped before any request"


def test_load_generator_processes_leave_ctrl_c_to_the_parent() -> None:
    """SIGINT reaching a load-generator process alone (the terminal signals the whole group;
    the parent stops them itself) neither ends it nor fails the point."""
    state = DoubleState(token_delay_s=0.05)  # 20 tokens: 1 s a request
    with OpenAIDouble(state) as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "bench", "--url", url, "--concurrency",
             "2", "--num-requests", "4", "--output-len", "20", "--input-len", "8", "--clients",
             "2", "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while len(state.requests) < 2:
                assert time.monotonic() < deadline and proc.poll() is None, "no requests"
                time.sleep(0.02)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in children:
                os.kill(int(pid), signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert children and proc.returncode == 0, err
    assert '"completed": 4' in out
