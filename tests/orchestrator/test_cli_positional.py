"""A config file given without its flag (`tandem serve configs/tiny-mono.yaml`, as other
serving CLIs take a positional model or config): the one line names the flag to use, with
the path the user typed, instead of "see tandem serve --help"."""

from __future__ import annotations

import pytest

from orchestrator.cli import main


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_a_bare_config_path_is_answered_with_the_flag(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "configs/tiny-mono.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: tandem {command}: unrecognized argument 'configs/tiny-mono.yaml'; "
                   "did you mean --config configs/tiny-mono.yaml?\n")


def test_a_bare_model_directory_is_answered_with_the_model_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "models/tandem-arith"]) == 2
    assert capsys.readouterr().err == (
        "error: tandem serve: unrecognized argument 'models/tandem-arith'; "
        "did you mean --model models/tandem-arith?\n")


def test_any_other_stray_word_still_points_at_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "now"]) == 2
    assert capsys.readouterr().err == (
        "error: tandem serve: unrecognized argument 'now'; see tandem serve --help\n")
