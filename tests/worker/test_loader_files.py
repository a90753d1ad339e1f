"""A checkpoint's safetensors files cut short or not safetensors at all: the worker refuses
them in one line naming the file (worker/arch/safetensors_file.py), before the safetensors
library's own error mid-load; `tandem worker` prints that line and exits 2, no traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT
from worker.arch.hf_config import ModelLoadError
from worker.arch.safetensors_file import read_header
from worker.config import ModelConfig, ParallelConfig
from worker.model.loader import load_model, weight_files

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def _random(file: Path) -> None:
    file.write_bytes(os.urandom(file.stat().st_size))


def _trailing(file: Path) -> None:
    with open(file, "ab") as fh:
        fh.write(b"\0" * 100)


@pytest.mark.parametrize(("breaks", "says"), [
    (_truncate, "truncated: its header's tensors need"),
    (_random, "not a safetensors file"),
    (_trailing, "longer than its tensors"),
])
def test_a_broken_weights_file_is_one_line_naming_it(
        tmp_path: Path, breaks: object, says: str) -> None:
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    read_header(model / "model.safetensors")  # the intact file passes
    breaks(model / "model.safetensors")  # type: ignore[operator]
    with pytest.raises(ModelLoadError) as exc:
        weight_files(model)
    assert str(exc.value).startswith(f"{model / 'model.safetensors'}: "), exc.value
    assert says in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ModelLoadError, match=says):
        load_model(ModelConfig(path=str(model)), ParallelConfig(device="cpu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("method", ["none", "eagle", "draft"])
def test_tandem_worker_refuses_a_truncated_checkpoint_in_one_line(
        tmp_path: Path, method: str) -> None:
    """The main model's file, or a speculative drafter's, cut to half: exit 2, one line."""
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    broken = model / ("model.safetensors" if method == "none" else f"{method}/model.safetensors")
    _truncate(broken)
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "worker", "--config", "configs/tiny-1p1d.yaml",
         "--role", "decode", "--port", str(_free_port()), "--set", f"model.path={model}",
         "--set", f"speculative.method={method}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{broken}: truncated" in last, out.stderr
