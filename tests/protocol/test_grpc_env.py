"""gRPC core's settings (protocol/grpc_env.py) are in a `tandem` process's environment when it
first imports grpc, which is when gRPC's core reads them; a value the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from protocol.grpc_env import GRPC_ENV

ROOT = Path(__file__).resolve().parents[2]

# Records GRPC_EXPERIMENTS as it is at the moment grpc is first imported, then runs what the
# `tandem` console script runs first (`from orchestrator.cli import main`).
_PROBE = """
import importlib.abc, os, sys
seen = []
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS", "<unset>"))
        return None
sys.meta_path.insert(0, Probe())
from orchestrator.cli import main
import grpc
print(seen[0])
"""


def _grpc_experiments_at_import(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def test_tandem_sets_grpc_env_before_grpc_is_imported() -> None:
    env = {k: v for k, v in os.environ.items() if k not in GRPC_ENV}
    assert _grpc_experiments_at_import(env) == GRPC_ENV["GRPC_EXPERIMENTS"]


def test_a_value_the_user_set_wins() -> None:
    env = {**os.environ, "GRPC_EXPERIMENTS": ""}
    assert _grpc_experiments_at_import(env) == ""
