"""`tandem eval` and `tandem bench` against an in-test OpenAI server double."""

from __future__ import annotations

import json

import pytest

from orchestrator import bench
from orchestrator.bench import BenchSpec, arrival_times, make_prompts, percentile
from orchestrator.cli import main
from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble

SEED = 7


def arith_state(**kw: object) -> DoubleState:
    problems = arith.make_problems(40, SEED)
    return DoubleState(answers={p.prompt: p.answer for p in problems}, **kw)  # type: ignore[arg-type]


def eval_argv(url: str, n: int = 20, bar: float = 0.9, conc: int = 4) -> list[str]:
    return ["eval", "--url", url, "--task", "arith", "--samples", str(n), "--concurrency", str(conc),
            "--min-accuracy", str(bar), "--seed", str(SEED)]


def test_eval_all_right_passes_and_sends_greedy_requests(capsys: pytest.CaptureFixture[str]) -> None:
    state = arith_state(token_delay_s=0.02)
    with OpenAIDouble(state) as url:
        assert main(eval_argv(url, n=20, conc=3)) == 0
    assert capsys.readouterr().out.strip() == "accuracy: 1.000 (20/20)"
    body = state.requests[0]
    assert body["model"] == "double-model"  # the first of /v1/models
    assert body["temperature"] == 0.0 and body["max_tokens"] == arith.ANSWER_MAX_TOKENS
    assert body["stop"] == [arith.STOP]
    assert 1 < state.max_inflight <= 3  # bounded, and actually concurrent


def test_eval_below_bar_fails(capsys: pytest.CaptureFixture[str]) -> None:
    state = arith_state(rule=lambda i, prompt: "wrong" if i % 4 == 0 else "right")
    with OpenAIDouble(state) as url:
        assert main(eval_argv(url, n=20, bar=0.9)) == 1
        assert main(eval_argv(url, n=20, bar=0.7)) == 0
    out = capsys.readouterr()
    assert "accuracy: 0.750 (15/20)" in out.out
    assert "below --min-accuracy 0.900" in out.err


def test_eval_failed_requests_count_as_wrong_and_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    state = arith_state(rule=lambda i, prompt: "fail" if i % 5 == 0 else "right")
    with OpenAIDouble(state) as url:
        assert main(eval_argv(url, n=20, bar=0.9)) == 1
    out = capsys.readouterr()
    assert "accuracy: 0.800 (16/20)" in out.out
    assert "failed requests: 4/20" in out.err and "HTTP 503: no healthy worker" in out.err


def test_eval_api_key_and_explicit_model(capsys: pytest.CaptureFixture[str]) -> None:
    state = arith_state(api_key="k1")
    with OpenAIDouble(state) as url:
        assert main(eval_argv(url, n=5)) == 2  # /v1/models refuses without the key
        assert "HTTP 401" in capsys.readouterr().err
        assert main([*eval_argv(url, n=5), "--api-key", "k1", "--model", "m"]) == 0
    assert state.requests[-1]["model"] == "m"


def test_eval_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(eval_argv("http://127.0.0.1:9", n=3)) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_eval_unknown_task(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://127.0.0.1:9", "--task", "arithm"]) == 2
    assert "arithm" in capsys.readouterr().err


def test_bench_numbers_present_and_sane(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(token_delay_s=0.005)
    with OpenAIDouble(state) as url:
        rc = main(["bench", "--url", url, "--input-len", "16", "--output-len", "8", "--num-requests", "12",
                   "--concurrency", "3", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 12 and s["failed"] == 0 and s["output_tokens"] == 12 * 8
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    assert 4.0 <= s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] < 1000  # ~5 ms per streamed chunk
    assert s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"] + 6 * 4.0
    assert s["request_throughput"] > 0 and s["output_throughput"] > s["request_throughput"]
    assert all(b["ignore_eos"] and b["stream"] and b["max_tokens"] == 8 and len(b["prompt"]) == 16 for b in state.requests)
    assert state.max_inflight <= 3


def test_bench_mixed_load_reports_groups_and_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState()
    with OpenAIDouble(state) as url:
        rc = main(["bench", "--url", url, "--input-len", "8", "--output-len", "4", "--num-requests", "9",
                   "--request-rate", "200", "--long-every", "3", "--long-input-len", "64", "--prompt-kind", "ids"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "requests: 9 ok, 0 failed" in out and "[short] 6 ok" in out and "[long] 3 ok" in out
    assert "TTFT ms" in out and "ITL ms" in out and "output tok/s" in out
    lengths = sorted(len(b["prompt"]) for b in state.requests)
    assert lengths == [8] * 6 + [64] * 3 and all(isinstance(t, int) for t in state.requests[0]["prompt"])


def test_bench_failures_make_it_fail(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(rule=lambda i, prompt: "fail" if i == 0 else "right")
    with OpenAIDouble(state) as url:
        assert main(["bench", "--url", url, "--num-requests", "3", "--output-len", "2", "--input-len", "4"]) == 1
    out = capsys.readouterr().out
    assert "2 ok, 1 failed" in out and "error: HTTP 503" in out


def test_bench_helpers() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    spec = BenchSpec(num_requests=6, long_every=2, input_len=3, long_input_len=5, request_rate=10.0, seed=1)
    prompts = make_prompts(spec)
    assert [k for k, _ in prompts] == ["short", "long"] * 3 and [len(p) for _, p in prompts] == [3, 5] * 3
    assert make_prompts(spec) == prompts  # deterministic in the seed
    times = arrival_times(spec)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    assert arrival_times(BenchSpec(num_requests=3)) == [0.0, 0.0, 0.0]
    assert bench.summarize([], 1.0, spec)["completed"] == 0
