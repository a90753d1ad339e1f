"""The dtype a checkpoint is served in under `model.dtype: auto`, as transformers and vLLM
read it: config.json's `dtype`, else its `torch_dtype` (transformers >= 5 writes both), else
the dtype the safetensors hold. Before, a config.json naming no dtype was served in float32
whatever its weights (transformers loads such a bfloat16 checkpoint in bfloat16), and
`tandem plan` read torch_dtype before dtype where the worker reads dtype first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli import main
from tests.worker.test_arch_variants import build
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine


def _edit(path: Path, **fields: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def _plan_kv_dtype(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["plan", "--config", "configs/tiny-mono.yaml", "--set", f"model.path={path}"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("role ") and "KV dtype" in line)
    row = next(line for line in out if line.startswith("both "))
    return row[header.index("KV dtype"):].split()[0]

@pytest.mark.parametrize(("fields", "want"), [
    ({"dtype": None, "torch_dtype": None}, torch.bfloat16),  # from the safetensors
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, torch.bfloat16),  # dtype wins
    ({"dtype": None, "torch_dtype": "float32"}, torch.float32),  # the older name alone
], ids=["no-dtype-field", "dtype-and-torch_dtype", "torch_dtype-only"])
def test_auto_dtype_is_what_transformers_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, object],
        want: torch.dtype) -> None:
    import transformers

    path = build(tmp_path, "llama", {}, dtype=torch.bfloat16)
    _edit(path, **fields)
    assert transformers.AutoModelForCausalLM.from_pretrained(path).dtype == want
    engine = Engine(WorkerConfig(model=ModelConfig(path=str(path)),
                                 cache=CacheConfig(page_size=4, num_pages=16), num_threads=1))
    assert engine.spec.dtype == want
    assert _plan_kv_dtype(path, capsys) == str(want).removeprefix("torch.")
