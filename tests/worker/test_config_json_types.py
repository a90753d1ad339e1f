"""config.json fields of the wrong JSON type are one line naming the file, the field, the
type it must have and what it holds (worker/arch/field_types.py), in the worker's parser and
in `tandem plan` / serve's preflight, never a Python error from int() or float() deep inside
a family's parser, and never a string read as true."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.config import REPO_ROOT
from worker.arch.hf_config import ModelLoadError
from worker.arch.load import load_arch_config

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"


def _copy(tmp_path: Path, changes: dict[str, Any], file: str = "config.json") -> Path:
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    cfg = json.loads((model / file).read_text())
    cfg.update(changes)
    (model / file).write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("field, value, says", [
    ("rms_norm_eps", "small", "rms_norm_eps must be a number, got 'small'"),
    ("rope_theta", [1], "rope_theta must be a number, got [1]"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings must be true or false, got 'yes'"),
    ("eos_token_id", "x", "eos_token_id must be a token id or a list of them, got 'x'"),
    ("eos_token_id", [1, "2"], "eos_token_id must be a token id or a list of them"),
    ("max_window_layers", 2.5, "max_window_layers must be an integer, got 2.5"),
    ("use_sliding_window", "false", "use_sliding_window must be true or false, got 'false'"),
    ("rope_scaling", "linear", "rope_scaling must be a JSON object or null, got 'linear'"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"},
     "rope_scaling.factor must be a number, got '2'"),
    ("num_key_value_heads", True, "num_key_value_heads must be a positive integer, got True"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object,
        says: str) -> None:
    model = _copy(tmp_path, {field: value})
    with pytest.raises(ModelLoadError, match=re.escape(says)) as exc:
        load_arch_config(model)
    assert str(exc.value).startswith(f"{model / 'config.json'}: "), exc.value
    assert main(["plan", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and says in err, err


def test_generation_config_eos_of_the_wrong_type_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(tmp_path, {"eos_token_id": {"id": 3}}, "generation_config.json")
    assert main(["plan", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{model / 'generation_config.json'}: eos_token_id must be a token id" in err, err


def test_architectures_as_a_string_says_it_must_be_a_list(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _copy(tmp_path, {"architectures": "Qwen3ForCausalLM"})
    assert main(["plan", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "architectures must be a list of strings, got 'Qwen3ForCausalLM'" in err, err


@pytest.mark.parametrize("method, text, says", [
    ("eagle", None, "hidden_size must be a positive integer, got 'x'"),
    ("mtp", "[1, 2]", "mtp/config.json: the top level must be a JSON object"),
])
def test_a_drafter_config_json_of_the_wrong_shape_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, text: str | None,
        says: str) -> None:
    model = _copy(tmp_path, {})
    head = model / method / "config.json"
    if text is None:
        cfg = json.loads(head.read_text())
        head.write_text(json.dumps({**cfg, "hidden_size": "x"}))
    else:
        head.write_text(text)
    assert main(["plan", "--model", str(model), "--set", f"speculative.method={method}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and says in err, err
    assert err.startswith("error: speculative.model "), err
