"""`tandem bench` flags refused before any request is sent, in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main

URL = "http://127.0.0.1:9"  # nothing listens: a flag that passed would say 'cannot reach'


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_out_that_is_a_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The whole run went first, then mkdir raised FileExistsError: a traceback, no results.
    file = tmp_path / "results.json"
    file.write_text("{}")
    assert main(["bench", "--url", URL, "--out", str(file)]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"error: --out {str(file)!r}") and "directory" in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--long-every", "2", "--long-input-len", "-5"], "--long-input-len must be >= 1, got -5"),
    (["--long-every", "-2"], "--long-every must be >= 0 (0 = no long requests), got -2"),
])
def test_long_request_flags_out_of_range(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # --long-input-len -5 sent empty prompts; --long-every -2 was taken as 0 without a word.
    assert main(["bench", "--url", URL, *flags]) == 2
    assert _one_line_error(capsys) == f"error: {named}"


def test_request_rate_nan_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # NaN passed `v <= 0`: every arrival after the first was at nan seconds.
    assert main(["bench", "--url", URL, "--request-rate", "2,nan"]) == 2
    assert _one_line_error(capsys) == "error: --request-rate values must be > 0, got '2,nan'"


def test_num_requests_help_says_shared_prefix_sends_whole_conversations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --dataset shared-prefix --num-turns 3 with the default 64 printed '63 ok, 0 failed' while
    # the help said 'requests per load point': whole conversations, num_requests // num_turns.
    assert main(["bench", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "num_requests // num_turns conversations" in help_text
