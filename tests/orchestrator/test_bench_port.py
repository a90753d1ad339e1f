"""`tandem bench --config` starts its own cluster: on a free port by default (beside a cluster
serving the config's port), on the port asked for with `--port N` or `--set gateway.port=N`;
what keeps it from starting (a taken port, a checkpoint the workers cannot load) is one line."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from orchestrator.cli import main
from orchestrator.config import REPO_ROOT

SMALL = ["--concurrency", "1", "--num-requests", "2", "--input-len", "8", "--output-len", "4",
         "--set", "roles.both.num_threads=1"]


@pytest.mark.parametrize("asks", [["--port", "8203"], ["--set", "gateway.port=8204"]])
def test_bench_config_serves_on_the_port_asked_for(
        capsys: pytest.CaptureFixture[str], asks: list[str]) -> None:
    port = asks[-1].rsplit("=", 1)[-1]
    assert main(["bench", "--config", "configs/tiny-mono.yaml", *asks, *SMALL]) == 0
    err = capsys.readouterr().err
    assert f"[bench] cluster up at http://127.0.0.1:{port}\n" in err, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_taken_port_is_one_line_before_the_engine_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 8205))
        busy.listen()
        assert main(["bench", "--config", "configs/tiny-mono.yaml", "--port", "8205",
                     *SMALL]) == 2
    err = capsys.readouterr().err
    assert "port 8205 (gateway" in _one_error_line(err) and "[bench] engine" not in err, err


def test_port_without_config_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--port", "8206"]) == 2
    assert "--port needs --config" in _one_error_line(capsys.readouterr().err)


def test_a_checkpoint_the_engine_cannot_load_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m"
    shutil.copytree(REPO_ROOT / "models" / "tandem-arith", model)
    weights = load_file(model / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert main(["bench", "--config", "configs/tiny-mono.yaml", "--set",
                 f"model.path={model}", *SMALL]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{model / 'model.safetensors'}: checkpoint lacks 1 tensors" in line, line
    (model / "model.safetensors").write_bytes(b"\xff" * 64)  # the launcher's checks: first
    assert main(["bench", "--config", "configs/tiny-mono.yaml", "--set",
                 f"model.path={model}", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "not a safetensors file" in _one_error_line(err) and "[bench] engine" not in err
