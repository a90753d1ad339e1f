"""Fixtures of the deploy tests: a checkpoint to serve and the local two-node Slurm cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT
from tests.conftest import without_session_marker

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
    cmd = [
        sys.executable,
        str(REPO_ROOT / "models" / "train_arith.py"),
        "--out",
        str(out),
        "--max-steps",
        "1",
        "--final-eval",
        "1",
        "--eval-samples",
        "1",
        "--threads",
        "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=240, cwd=REPO_ROOT)
    return out


LOCAL_CLUSTER = REPO_ROOT / "deploy" / "slurm" / "local-cluster.sh"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """deploy/slurm/local-cluster.sh up: a real two-node cluster on this machine, brought down
    again at the end of the session when this session brought it up (one that was already up
    belongs to someone else and is left alone)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (network namespaces, slurmd)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("no Slurm and no apt-get to install it")
    # Session-wide infrastructure: its daemons must not count as this module's leftovers.
    env = without_session_marker()
    was_up = (
        subprocess.run(
            ["bash", str(LOCAL_CLUSTER), "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        ).returncode
        == 0
    )
    up = subprocess.run(
        ["bash", str(LOCAL_CLUSTER), "up"], capture_output=True, text=True, timeout=300, env=env
    )
    assert up.returncode == 0, up.stdout + up.stderr
    yield
    if not was_up:
        down = subprocess.run(
            ["bash", str(LOCAL_CLUSTER), "down"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert down.returncode == 0, down.stdout + down.stderr
