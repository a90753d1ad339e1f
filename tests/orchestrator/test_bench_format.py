"""What `tandem bench` prints for a person (orchestrator/bench_stats.py's formatting)."""

from __future__ import annotations

from orchestrator.bench_stats import RequestResult, format_summary, summarize_results


def _ok(kind: str, ttft_s: float) -> RequestResult:
    return RequestResult(kind, ok=True, ttft_s=ttft_s, itl_s=[0.01, 0.01], e2e_s=ttft_s + 0.02,
                         output_tokens=3)


def test_a_group_with_no_completed_request_prints_no_latencies_of_zero() -> None:
    """Mixed load where every long request failed (a prompt past the model's context): the
    long group's line says so, instead of percentiles of 0.00 ms that read as measured."""
    results = [_ok("short", 0.05), _ok("short", 0.06),
               RequestResult("long", error="HTTP 400: prompt too long")]
    text = format_summary(summarize_results(results, 1.0, "concurrency 2", {}))
    lines = text.splitlines()
    at = lines.index("[long] 0 ok, 1 failed: no latencies")
    assert not lines[at + 1].lstrip().startswith(("TTFT", "ITL", "E2E"))
    assert lines[lines.index("[short] 2 ok, 0 failed") + 1].lstrip().startswith("TTFT ms")
    assert lines[-1] == "error: HTTP 400: prompt too long"
