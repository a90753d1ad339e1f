"""`tandem plan` takes serve's `--port`: a user planning what `tandem serve --port N` (the
README's second-cluster line) would run got 'unrecognized argument --port' instead."""

from __future__ import annotations

import pytest

from orchestrator.cli import main


def test_plan_shows_the_gateway_on_the_port_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", "configs/tiny-mono.yaml", "--port", "21800"]) == 0
    lb = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lb ")]
    assert len(lb) == 1 and lb[0].split()[4] == "21800", lb


def test_plan_refuses_a_port_out_of_range_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--port", "99999"]) == 2
    assert capsys.readouterr().err == (
        "error: --port 99999: gateway.port must be within 1..65535, got 99999\n")
