"""`tandem eval` and `tandem bench` against an in-test OpenAI server double."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator import bench
from orchestrator.bench import BenchSpec, make_prompts, make_sessions
from orchestrator.bench_data import DatasetError, arrival_times
from orchestrator.bench_stats import (
    RequestResult,
    percentile,
    token_latencies,
    wave_decode_rate,
)
from orchestrator.cli import main
from orchestrator.eval import run_eval
from orchestrator.progress import Progress
from orchestrator.tasks import arith
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble

SEED = 7


def arith_state(**kw: object) -> DoubleState:
    problems = arith.make_problems(40, SEED)
    return DoubleState(answers={p.prompt: p.answer for p in problems}, **kw)  # type: ignore[arg-type]


def eval_argv(url: str, n: int = 20, bar: float = 0.9, conc: int = 4) -> list[str]:
    return ["eval", "--url", url, "--task", "arith", "--samples", str(n),
            "--concurrency", str(conc), "--min-accuracy", str(bar), "--seed", str(SEED)]


def test_eval_all_right_passes_and_sends_greedy_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
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


def test_eval_failed_requests_count_as_wrong_and_are_reported(
    capsys: pytest.CaptureFixture[str],
) -> None:
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
        assert main([*eval_argv(url, n=5), "--api-key", "k1", "--model", "m"]) == 2  # not listed
        assert "--model 'm' is not served at" in capsys.readouterr().err
        state.model = "m"  # now the server lists it
        assert main([*eval_argv(url, n=5), "--api-key", "k1", "--model", "m"]) == 0
    assert state.requests[-1]["model"] == "m"


def test_eval_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(eval_argv("http://127.0.0.1:9", n=3)) == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_url_without_its_scheme_is_one_line(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--url", "127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --url '127.0.0.1:8000' is not an http(s) URL; give one like "
                   "http://127.0.0.1:8000")


def test_eval_unknown_task(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://127.0.0.1:9", "--task", "arithm"]) == 2
    assert "arithm" in capsys.readouterr().err


def test_bench_numbers_present_and_sane(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(token_delay_s=0.005)
    with OpenAIDouble(state) as url:
        rc = main(["bench", "--url", url, "--input-len", "16", "--output-len", "8",
                   "--num-requests", "12", "--concurrency", "3", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 12 and s["failed"] == 0 and s["output_tokens"] == 12 * 8
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    assert 4.0 <= s["itl_ms"]["p50"] <= s["itl_ms"]["p99"] < 1000  # ~5 ms per streamed chunk
    assert s["e2e_ms"]["p50"] >= s["ttft_ms"]["p50"] + 6 * 4.0
    assert s["request_throughput"] > 0 and s["output_throughput"] > s["request_throughput"]
    assert all(
        b["ignore_eos"] and b["stream"] and b["max_tokens"] == 8 and len(b["prompt"]) == 16
        for b in state.requests
    )
    assert state.max_inflight <= 3


def test_bench_from_several_processes_sends_the_same_load(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--clients 3: the 12 requests of the one-process run, split over three processes whose
    concurrency adds up to the 4 asked for; an unreachable server still exits 2."""
    argv = ["bench", "--input-len", "16", "--output-len", "4", "--num-requests", "12",
            "--concurrency", "4", "--prompt-kind", "ids", "--vocab-size", "1000", "--json"]
    sent = []
    for clients in ("1", "3"):
        state = DoubleState(token_delay_s=0.02)
        with OpenAIDouble(state) as url:
            assert main([*argv, "--url", url, "--clients", clients]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["completed"] == 12 and s["failed"] == 0 and s["output_tokens"] == 12 * 4
        assert state.max_inflight <= 4
        sent.append(sorted(tuple(b["prompt"]) for b in state.requests))
    assert sent[0] == sent[1] and len(set(sent[0])) == 12
    assert main(["bench", "--url", "http://127.0.0.1:9", "--clients", "2"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def _share_that_raises(k: int, n: int, ready: Callable[[], None]) -> None:
    ready()
    raise ValueError(f"share {k} broke")


def _share_that_dies(k: int, n: int, ready: Callable[[], None]) -> None:
    ready()
    os._exit(3)


def test_a_failing_load_process_is_one_named_error() -> None:
    from orchestrator.bench_procs import LoadError, run_processes

    with pytest.raises(LoadError, match=r"process (\d) of 2: ValueError: share \1 broke"):
        run_processes(_share_that_raises, (), 2)
    with pytest.raises(LoadError, match="exited with status 3"):
        run_processes(_share_that_dies, (), 2)


def test_bench_mixed_load_reports_groups_and_text_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = DoubleState()
    with OpenAIDouble(state) as url:
        rc = main(["bench", "--url", url, "--input-len", "8", "--output-len", "4",
                   "--num-requests", "9", "--request-rate", "200", "--long-every", "3",
                   "--long-input-len", "64", "--prompt-kind", "ids"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "requests: 9 ok, 0 failed" in out and "[short] 6 ok" in out and "[long] 3 ok" in out
    assert "TTFT ms" in out and "ITL ms" in out and "output tok/s" in out
    lengths = sorted(len(b["prompt"]) for b in state.requests)
    assert lengths == [8] * 6 + [64] * 3 and all(
        isinstance(t, int) for t in state.requests[0]["prompt"]
    )


def test_bench_failures_make_it_fail(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(rule=lambda i, prompt: "fail" if i == 0 else "right")
    with OpenAIDouble(state) as url:
        assert main(["bench", "--url", url, "--num-requests", "3", "--output-len", "2",
                     "--input-len", "4"]) == 1
    out = capsys.readouterr().out
    assert "2 ok, 1 failed" in out and "error: HTTP 503" in out


def test_bench_helpers() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    spec = BenchSpec(
        num_requests=6, long_every=2, input_len=3, long_input_len=5, request_rate=10.0, seed=1
    )
    prompts = make_prompts(spec)
    assert (
        [k for k, _ in prompts] == ["short", "long"] * 3
        and [len(p) for _, p in prompts] == [3, 5] * 3
    )
    assert make_prompts(spec) == prompts  # deterministic in the seed
    times = arrival_times(6, 10.0, 1)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    assert arrival_times(3, 0.0, 0) == [0.0, 0.0, 0.0]
    assert bench.summarize([], 1.0, spec)["completed"] == 0


def test_range_ratio_spreads_both_lengths_and_keeps_the_exact_load() -> None:
    exact = BenchSpec(num_requests=40, input_len=20, output_len=30, prompt_kind="ids", seed=3)
    spread = dataclasses.replace(exact, range_ratio=0.5)
    sessions = make_sessions(spread)
    ins = [len(s.turns[0]) for s in sessions]
    outs = [s.max_tokens for s in sessions]
    assert all(10 <= n <= 30 for n in ins) and all(15 <= n <= 45 for n in outs)
    assert len(set(ins)) > 5 and len(set(outs)) > 5  # spread, not one length
    assert make_sessions(spread) == sessions  # deterministic in the seed
    assert {len(s.turns[0]) for s in make_sessions(exact)} == {20}  # 0: exact lengths


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_itl_is_per_token_from_arrival_times() -> None:
    """A scripted stream with known token times: 1 token, then after 200 ms 1, after 200 ms two
    events in one write, after 400 ms one event of 2 tokens, after 200 ms 1. Per token: the
    gaps 200, 100, 100, 200, 200, 200 ms (a per-SSE-line timer would say 200, 200, 0, 400, 200).
    The double stamps each write as it leaves (same clock, same process): the bench's figures
    must match those stamps within 100 ms, half the smallest write gap (with gaps a quarter of
    these and 30 ms, a loaded box's reader woke late past the bound); the split of a
    multi-token event is checked exactly, by the equal gaps it must give."""
    tokens_per_write = [1, 1, 2, 2, 1]
    writes = [(0.0, [1]), (0.2, [1]), (0.2, [1, 1]), (0.4, [2]), (0.2, [1])]
    tolerance = 0.1  # s, on each gap
    results, stamps = [], []
    for ids in (True, False):
        state = DoubleState(writes=writes)
        with OpenAIDouble(state) as url:
            spec = BenchSpec(input_len=4, output_len=7, num_requests=1, concurrency=1,
                             return_token_ids=ids)
            results.append(asyncio.run(bench.run_bench(url, spec))[0][0])
        stamps.append(state.write_times)
        assert state.requests[0].get("return_token_ids", False) is ids
    with_ids, without = results
    _, want = token_latencies(0.0, list(zip(stamps[0], tokens_per_write, strict=True)))
    assert with_ids.ok and with_ids.output_tokens == 7 and len(with_ids.itl_s) == 6
    for got, expected in zip(with_ids.itl_s, want, strict=True):
        assert abs(got - expected) < tolerance, (with_ids.itl_s, want)
    assert with_ids.itl_s[1] == with_ids.itl_s[2] and with_ids.itl_s[3] == with_ids.itl_s[4]
    # TPOT spans the 6 gaps: a late first or last read moves it by a sixth of its lateness
    assert abs(with_ids.tpot_s - (stamps[0][-1] - stamps[0][0]) / 6) < tolerance / 6
    # without token ids each event counts one token: the 2-token event is one gap
    _, want = token_latencies(0.0, list(zip(stamps[1], [1, 1, 2, 1, 1], strict=True)))
    assert len(without.itl_s) == 5
    for got, expected in zip(without.itl_s, want, strict=True):
        assert abs(got - expected) < tolerance, (without.itl_s, want)
    assert token_latencies(1.0, [(1.5, 2), (2.0, 4)]) == (0.5, [0.125] * 4)


def test_decode_rate_counts_the_first_waves_window_only() -> None:
    """Two requests sent at 0 (the wave), a token each 0.1 s, and one sent at the first finish:
    the window runs from the wave's last first token (t=3) to the first finish (t=7); the third
    request and every first token lie outside it."""
    def done(start: float, arrivals: list[tuple[float, int]]) -> RequestResult:
        res = RequestResult("short", ok=True, start_s=start, arrivals=arrivals,
                            output_tokens=sum(n for _, n in arrivals))
        res.ttft_s, res.itl_s = token_latencies(start, arrivals)
        res.e2e_s = arrivals[-1][0] - start
        return res

    def every_tenth(first: int, last: int) -> list[tuple[float, int]]:  # times in 0.1 s
        return [(k / 10, 1) for k in range(first, last + 1)]

    a = done(0.0, every_tenth(10, 70))  # finishes first, at 7
    b = done(0.0, every_tenth(30, 90))
    c = done(7.0, every_tenth(71, 80))  # the first finish freed its seat
    # in (3, 7]: 40 tokens of a and 40 of b over 4 s
    assert wave_decode_rate([a, b, c]) == 80 / 4
    # a wave member's first token after the first finish: no window
    late = done(0.0, [(7.2, 1), (7.3, 1)])
    assert wave_decode_rate([a, b, late]) is None
    assert wave_decode_rate([a, RequestResult("short", error="x")]) is None
    assert wave_decode_rate([]) is None
    # a window under MIN_WINDOW_STEPS of the median TPOT (0.5 s against 16 x 0.55 s): the
    # burst at its end would read as 44 tok/s
    burst = done(0.0, [(0.1, 1), (8.9, 1), (8.95, 20), (9.0, 1)])
    slow = done(0.0, [(8.5, 1), (9.1, 1), (9.6, 1)])
    assert wave_decode_rate([burst, slow]) is None


def test_a_sweep_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(token_delay_s=0.002)
    with OpenAIDouble(state) as url:
        rc = main(["bench", "--url", url, "--input-len", "8", "--output-len", "4",
                   "--num-requests", "6", "--concurrency", "1,3", "--out", str(tmp_path / "o")])
    assert rc == 0
    out = capsys.readouterr()
    assert "concurrency 1" in out.out and "concurrency 3" in out.out and "TTFT p50" in out.out
    data = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [p["concurrency"] for p in data["points"]] == [1, 3]
    assert all(len(p["samples"]["itl_ms"]) == 6 * 3 for p in data["points"])
    for name in ("latency_throughput.png", "itl_cdf.png"):
        png = (tmp_path / "o" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert state.max_inflight <= 3


def test_all_failed_prints_the_error_not_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    state = DoubleState(rule=lambda i, prompt: "fail")
    with OpenAIDouble(state) as url:
        assert main(["bench", "--url", url, "--num-requests", "3", "--output-len", "2"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert "error: all 3 requests failed (concurrency 4)" in out.err
    assert "HTTP 503: no healthy worker" in out.err and "TTFT" not in out.err


def test_datasets_shared_prefix_turns_and_jsonl(tmp_path: Path) -> None:
    state = DoubleState()
    with OpenAIDouble(state) as url:
        spec = BenchSpec(dataset="shared-prefix", num_requests=6, num_turns=3, num_groups=1,
                         prefix_len=20, input_len=5, output_len=2, concurrency=2)
        results, _ = asyncio.run(bench.run_bench(url, spec))
        assert len(results) == 6 and all(r.ok for r in results)
        prompts = [b["prompt"] for b in state.requests]
        prefix = prompts[0].split("\n")[0]
        assert all(p.startswith(prefix) for p in prompts)  # one group: one system prompt
        turn3 = max(prompts, key=len)
        # the answers the server gave are fed back in the later turns
        assert turn3.count("assistant: ") == 3 and "assistant: aa\nuser:" in turn3
        lines = [json.dumps({"prompt": "hello", "max_tokens": 3}), json.dumps({"prompt": [1, 2]})]
        (tmp_path / "d.jsonl").write_text("\n".join(lines))
        state.requests.clear()
        spec = BenchSpec(dataset=f"jsonl:{tmp_path / 'd.jsonl'}", num_requests=3, output_len=5)
        results, _ = asyncio.run(bench.run_bench(url, spec))
        assert [b["prompt"] for b in state.requests].count("hello") == 2
        assert sorted(b["max_tokens"] for b in state.requests) == [3, 3, 5]
    (tmp_path / "bad.jsonl").write_text('{"prompt": 5}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: `prompt` must be text"):
        make_sessions(BenchSpec(dataset=f"jsonl:{tmp_path / 'bad.jsonl'}"))
    assert main(["bench", "--url", "http://127.0.0.1:9", "--dataset", "csv"]) == 2
    assert main(["bench", "--url", "http://127.0.0.1:9", "--concurrency", "1,x"]) == 2


def test_progress_bars_draw_on_a_terminal_only() -> None:
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(4, "c=2", stream)
        for ok in (True, False, True, True):
            bar.advance(ok)
        bar.close()
    assert pipe.getvalue() == ""
    assert tty.getvalue().endswith("c=2 [" + "#" * 30 + "] 4/4  " + tty.getvalue().split(
        "4/4  ")[-1]) and "1 failed" in tty.getvalue() and tty.getvalue().startswith("\r")
    state = arith_state()
    with OpenAIDouble(state) as url:
        tty = _Tty()
        asyncio.run(run_eval(url, arith, 6, 2, SEED, progress_stream=tty))
    assert "eval arith [" in tty.getvalue() and "6/6" in tty.getvalue()
