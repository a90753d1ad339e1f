"""`tandem plan --model DIR` refuses the checkpoint problems `tandem serve` refuses, in the same
one line (README: "in `tandem serve` and in `tandem plan`"). It printed a plan for an
unsupported architecture, a pytorch_model.bin-only checkpoint, a missing shard and a broken or
slow-only tokenizer, which `tandem serve` then refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.cli import main
from tests.orchestrator.test_checkpoint import CASES, copy_model


@pytest.mark.parametrize(("breaks", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_refuses_what_serve_refuses_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], breaks: Callable[[Path], None],
        message: str) -> None:
    model = copy_model(tmp_path)
    breaks(model)
    assert main(["plan", "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_plan_of_a_sound_checkpoint_still_prints_its_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(copy_model(tmp_path))]) == 0
    assert "KV cache groups" in capsys.readouterr().out
