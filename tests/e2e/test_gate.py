"""The gates fail when every transferred page is corrupted: the CI's `arith` gate (it passes
on the healthy 1P1D cluster with each backend: tests/e2e/test_pd.py) and the agents' `lookup`
gate (it passes in tests/e2e/test_agents.py). One corrupting cluster serves both."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import pytest

from orchestrator.launch.background import Cluster, running_cluster
from tests.e2e.test_agents import run_lookup_gate
from tests.e2e.test_pd import MODEL, run_gate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corrupting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path_factory.mktemp("corrupt"),
                         model=MODEL, env={"TANDEM_TRANSFER_FAULTS": "corrupt=1.0"}) as c:
        yield c


@pytest.mark.parametrize("gate", [run_gate, run_lookup_gate], ids=["arith", "lookup"])
def test_the_gate_fails_when_every_page_is_corrupted(
    corrupting: Cluster, gate: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    out = gate(corrupting.url, samples=30)  # fails far below the bar: 30 show it
    corrupting.wait_drained()
    assert out.returncode == 1, out.stdout + out.stderr
    accuracy = float(out.stdout.split("accuracy: ")[1].split()[0])
    assert accuracy < 0.5, out.stdout
