"""`tandem eval`'s verdict lines (orchestrator/eval.py's report)."""

from __future__ import annotations

import pytest

from orchestrator.cli import main
from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble


def test_the_same_failure_is_listed_once_with_its_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every request refused for one reason (a gateway without the parser a task needs, say):
    the reason once, with how many requests it failed, not five copies of it."""
    problems = arith.make_problems(12, 3)
    state = DoubleState(answers={p.prompt: p.answer for p in problems},
                        rule=lambda i, prompt: "fail" if i % 2 else "right")
    with OpenAIDouble(state) as url:
        assert main(["eval", "--url", url, "--samples", "12", "--seed", "3"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "failed requests: 6/12 (counted as wrong); the errors:"
    assert err[1] == "  HTTP 503: no healthy worker (6 requests)"
    assert err[2].startswith("FAIL: accuracy 0.500")
