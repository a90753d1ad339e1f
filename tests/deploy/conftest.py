"""Fixtures of the deploy tests: a checkpoint to serve and the local two-node Slurm cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT

EMBEDDED_MODEL = REPO_ROOT / "models" / "tandem-arith"


def real_model_present() -> bool:
    """The trained embedded model is committed: the gate must then pass, not only run."""
    return (EMBEDDED_MODEL / "config.json").is_file()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model, or (until it lands) a 1-step plumbing checkpoint of the same family."""
    if real_model_present():
        return EMBEDDED_MODEL
    out = tmp_path_factory.mktemp("arith-plumbing")
    cmd = [sys.executable, str(REPO_ROOT / "models" / "train_arith.py"), "--out", str(out),
           "--max-steps", "1", "--final-eval", "1", "--eval-samples", "1", "--threads", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=240, cwd=REPO_ROOT)
    return out


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """deploy/slurm/local-cluster.sh up (idempotent): a real two-node cluster on this machine."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (network namespaces, slurmd)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("no Slurm and no apt-get to install it")
    up = subprocess.run(["bash", str(REPO_ROOT / "deploy" / "slurm" / "local-cluster.sh"), "up"],
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
