"""config.json fields `tandem plan` and `tandem serve` read as numbers: a checkpoint whose
config.json is not JSON, misses one or holds something else there is one line naming the file
and the field (plan used to raise JSONDecodeError / TypeError / ValueError tracebacks, and serve
one for a non-integer max_position_embeddings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "models" / "tandem-arith"


def _ckpt(tmp: Path, edit: dict | None = None, text: str | None = None) -> Path:
    path = tmp / "ckpt"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(EMBEDDED / name, path / name)
    cfg = json.loads((EMBEDDED / "config.json").read_text())
    cfg.update(edit or {})
    (path / "config.json").write_text(text if text is not None else json.dumps(cfg))
    return path


@pytest.mark.parametrize(("edit", "text", "says"), [
    ({"num_attention_heads": None}, None, "required field 'num_attention_heads' is missing"),
    ({"max_position_embeddings": "big"}, None,
     "max_position_embeddings must be a positive integer, got 'big'"),
    ({"num_hidden_layers": "4"}, None, "num_hidden_layers must be a positive integer, got '4'"),
    ({"head_dim": 7.5}, None, "head_dim must be a positive integer, got 7.5"),
    (None, "{bad", "not valid JSON"),
])
def test_plan_names_a_bad_config_json_field_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict | None, text: str | None,
        says: str) -> None:
    ckpt = _ckpt(tmp_path, edit, text)
    code = main(["plan", "--config", str(REPO / "configs" / "tiny-1p1d.yaml"),
                 "--set", f"model.path={ckpt}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {ckpt / 'config.json'}: ") and says in err, err


def test_serve_preflight_names_a_non_integer_max_position_embeddings(tmp_path: Path) -> None:
    from orchestrator.checkpoint import CheckpointError, check_checkpoint

    ckpt = _ckpt(tmp_path, {"max_position_embeddings": "big"})
    with pytest.raises(CheckpointError, match=r"max_position_embeddings must be a positive "
                                              r"integer, got 'big'"):
        check_checkpoint(str(ckpt))


def test_plan_checks_the_fields_serve_checks() -> None:
    from orchestrator import checkpoint, plan

    checked = {*plan._REQUIRED_FIELDS, *plan._OPTIONAL_FIELDS}
    assert checked == {*checkpoint.REQUIRED_FIELDS, *checkpoint.OPTIONAL_FIELDS}
    assert set(plan._REQUIRED_FIELDS) <= set(checkpoint.REQUIRED_FIELDS)
