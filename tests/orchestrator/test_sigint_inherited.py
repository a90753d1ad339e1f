"""SIGINT reaches a `tandem` command that was started with SIGINT ignored.

A shell script's `tandem serve ... &` (no job control) starts the command with SIGINT ignored,
and Python then installs no KeyboardInterrupt handler: `kill -INT $pid` was lost until the
launcher's own handler came in, so a serve interrupted during its checks went on to start the
whole cluster. Shown here with `tandem eval` against the slowed OpenAI double (the same
program entry point; the signal is sent once the double has seen requests, a state).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble
from tests.orchestrator.test_client_interrupt import ROOT


def _ignore_sigint() -> None:  # what bash does for a background job without job control
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_kill_int_reaches_a_command_started_with_sigint_ignored() -> None:
    problems = arith.make_problems(300, 7)
    state = DoubleState(answers={p.prompt: p.answer for p in problems}, token_delay_s=0.2)
    with OpenAIDouble(state) as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "eval", "--url", url, "--task", "arith",
             "--samples", "300", "--seed", "7", "--concurrency", "2"], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_ignore_sigint)
        try:
            deadline = time.monotonic() + 60
            while len(state.requests) < 2:
                assert time.monotonic() < deadline and proc.poll() is None, "no requests"
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)  # `kill -INT $pid`
            _, err = proc.communicate(timeout=30)  # ignored, it would run 300 problems on
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("interrupted: "), err
