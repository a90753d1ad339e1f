"""Bad input outside HTTP: each is one line naming the field or file and the fix, with a
non-zero exit, never a traceback (the serve side of a worker's refusal, config sections in
the wrong place, flags)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from orchestrator.cli import main
from orchestrator.config import REPO_ROOT

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"


def test_serve_reports_a_workers_refusal_as_the_clusters_failure_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint only the worker can refuse (a tensor missing from a well-formed file: the
    launcher reads headers, not tensors): the worker's one line is serve's one line."""
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.0.mlp.gate_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--port", "8201",
                 "--set", f"launcher.log_dir={logs}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: cluster did not start: "), err
    assert "-0 refused to start: " in err, err
    assert f"{model / 'model.safetensors'}: checkpoint lacks 1 tensors" in err, err
    assert "model.layers.0.mlp.gate_proj.weight" in err and "(log: " in err, err


@pytest.mark.parametrize("section", ["speculative", "transfer", "model", "gateway"])
def test_a_top_level_section_under_a_role_says_it_is_top_level(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str) -> None:
    """`speculative:` under `roles.decode:` is not a typo of `scheduler`: the fix is to move it."""
    config = tmp_path / "c.yaml"
    config.write_text(f"roles:\n  prefill: {{}}\n  decode:\n    {section}:\n      x: 1\n")
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"'{section}' is a top-level section" in err and "roles.decode" in err, err
    assert "Did you mean" not in err, err
    assert main(["plan", "--set", f"roles.decode.{section}.x=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{section}' is a top-level section" in err, err
    assert f"set {section}.x instead" in err, err
