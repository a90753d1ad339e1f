"""`tandem plan` on a checkpoint whose safetensors file is cut short (an interrupted download):
one line naming the file, as `tandem serve`'s preflight says it; it used to be a JSONDecodeError
traceback from the weight-bytes column."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "models" / "tandem-arith"


@pytest.mark.parametrize("keep", [1000, 4])
def test_plan_names_a_truncated_safetensors_file_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], keep: int) -> None:
    ckpt = tmp_path / "cut"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, ckpt / name)
    (ckpt / "model.safetensors").write_bytes((EMBEDDED / "model.safetensors").read_bytes()[:keep])
    code = main(["plan", "--config", str(REPO / "configs" / "tiny-1p1d.yaml"),
                 "--set", f"model.path={ckpt}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"error: {ckpt / 'model.safetensors'}: not a safetensors file"), err
