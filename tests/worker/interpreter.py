"""Run a Triton kernel test's script under the interpreter (`TRITON_INTERPRET=1`) in a fresh
process: the variable is read when triton is first imported, so CI checks kernels on CPU
without setting it for the whole suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(script: str, timeout_s: float = 300) -> None:
    """Run `script` (python source) from the repo root with TRITON_INTERPRET=1; assert it
    exits 0, with its output in the message when it does not."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stdout + out.stderr
