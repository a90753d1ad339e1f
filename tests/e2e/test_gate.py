"""The gates fail when every transferred page is corrupted: the CI's `arith` gate (it passes
on the healthy 1P1D cluster with each backend: tests/e2e/test_pd.py) and the agents' `lookup`
gate (it passes in tests/e2e/test_agents.py). One corrupting cluster serves both."""

from __future__ import annotations

from collections.abc import Iterator

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


def test_gate_fails_when_every_page_is_corrupted(corrupting: Cluster) -> None:
    gate = run_gate(corrupting.url, samples=30)  # fails far below the bar: 30 show it
    corrupting.wait_drained()
    assert gate.returncode == 1, gate.stdout + gate.stderr
    accuracy = float(gate.stdout.split("accuracy: ")[1].split()[0])
    assert accuracy < 0.5, gate.stdout


def test_lookup_gate_fails_when_every_page_is_corrupted(corrupting: Cluster) -> None:
    gate = run_lookup_gate(corrupting.url, samples=30)  # fails far below the bar: 30 show it
    corrupting.wait_drained()
    assert gate.returncode == 1, gate.stdout + gate.stderr
    accuracy = float(gate.stdout.split("accuracy: ")[1].split()[0])
    assert accuracy < 0.5, gate.stdout
