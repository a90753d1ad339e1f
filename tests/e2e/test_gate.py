"""The CI gate: the default 1P1D cluster answers the `arith` task correctly with each transfer
backend, and the same gate fails when every transferred page is corrupted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, REPO, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow


def run_gate(url: str, samples: int = 100) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "eval",
        "--url",
        url,
        "--task",
        "arith",
        "--samples",
        str(samples),
        "--concurrency",
        "8",
        "--min-accuracy",
        "0.90",
    ]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_gate_passes_on_1p1d(backend: str, tmp_path: Path) -> None:
    with running_cluster(
        "configs/tiny-1p1d.yaml", f"transfer.backend={backend}", tmp=tmp_path, model=MODEL
    ) as c:
        gate = run_gate(c.url)
        c.wait_drained()
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "accuracy: " in gate.stdout


def test_gate_fails_when_every_page_is_corrupted(tmp_path: Path) -> None:
    with running_cluster(
        "configs/tiny-1p1d.yaml",
        tmp=tmp_path,
        model=MODEL,
        env={"TANDEM_TRANSFER_FAULTS": "corrupt=1.0"},
    ) as c:
        gate = run_gate(c.url, samples=30)  # fails far below the bar: 30 show it
        c.wait_drained()
    assert gate.returncode == 1, gate.stdout + gate.stderr
    accuracy = float(gate.stdout.split("accuracy: ")[1].split()[0])
    assert accuracy < 0.5, gate.stdout
