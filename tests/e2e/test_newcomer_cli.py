"""The CLI as a newcomer uses it: `tandem eval` / `tandem bench` given the URL an OpenAI
client is given (http://host:port/v1), which names the same server as its root URL."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_eval_takes_the_openai_base_url(suffix: str, capsys: pytest.CaptureFixture[str]) -> None:
    problems = arith.make_problems(4, 7)
    state = DoubleState(answers={p.prompt: p.answer for p in problems})
    with OpenAIDouble(state) as url:
        rc = main(["eval", "--url", url + suffix, "--task", "arith", "--samples", "4",
                   "--concurrency", "2", "--seed", "7"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() == "accuracy: 1.000 (4/4)"


def test_bench_takes_the_openai_base_url(capsys: pytest.CaptureFixture[str]) -> None:
    with OpenAIDouble(DoubleState()) as url:
        rc = main(["bench", "--url", url + "/v1", "--input-len", "8", "--output-len", "4",
                   "--num-requests", "3", "--concurrency", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["completed"] == 3


def test_bench_prints_the_percentiles_the_readme_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README: `tandem bench` reports TTFT, TPOT, ITL and E2E at p50/p90/p95/p99; its text
    report printed p95 only under --json."""
    with OpenAIDouble(DoubleState()) as url:
        rc = main(["bench", "--url", url, "--input-len", "8", "--output-len", "4",
                   "--num-requests", "3", "--concurrency", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = {line.split(" ms")[0]: line for line in out.out.splitlines() if " ms " in line}
    assert set(rows) == {"TTFT", "TPOT", "ITL", "E2E"}, out.out
    for row in rows.values():
        assert [w for w in row.split() if w.startswith("p")] == ["p50", "p90", "p95", "p99"], row
