"""The figures `tandem bench` reports, from per-token arrival times.

Token arrival: the client stamps each network read of the SSE stream when it arrives, and a
read carries as many tokens as its events' `token_ids` (or one per event with text when the
server does not send ids). TTFT is the first read with a token, minus the send time. ITL is
per token: a read's gap since the previous read, shared evenly by its tokens (the rule of
SGLang's bench_serving) -- so k tokens that arrive in one burst count as k gaps of a k-th of
the wait, not as one real gap and k-1 gaps of zero, and a server that sends one token per
event is measured by its events. TPOT is per request: (E2E - TTFT) / (output tokens - 1).
Percentiles are linear-interpolated (numpy's default), over all tokens (ITL) or all requests.

Decode rate (`wave_decode_rate`): the tokens clients received while the first wave (the
requests sent before any finished: a closed loop's first B) all had their first token and none
had finished, over that window. No prompt is computed then (none is waiting), so it is the
decode rate at batch B as clients receive it: the window the engine's decode rate is measured
over (orchestrator/bench_engine.py), and for a PD cluster its decode worker's own rate even when
its prefill worker shares the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QUANTILES = (50, 90, 95, 99)
# The shortest first-wave window that measures a decode rate, in steps (the wave's median TPOT,
# which a stream's bursts do not shorten): a stream that stalls and then delivers in a burst
# moves the window's count by up to a step's tokens, which a short window would take for a rate.
MIN_WINDOW_STEPS = 16


@dataclass
class RequestResult:
    kind: str  # short | long (mixed load) or the dataset's name
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one per output token after the first
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0  # from usage when the server streams it, else 0
    text: str = ""  # the answer (a multi-turn session sends it back in the next turn)
    start_s: float = 0.0  # send time (time.perf_counter: one clock for every client process)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (read time, its tokens)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 \
            else 0.0


def token_latencies(start: float, arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """(TTFT, per-token ITLs) from (arrival time, tokens) of each read that carried tokens."""
    if not arrivals:
        return 0.0, []
    ttft = arrivals[0][0] - start
    itl: list[float] = []
    for (prev, _), (now, n) in zip(arrivals, arrivals[1:], strict=False):
        itl += [(now - prev) / n] * n
    return ttft, itl


def wave_decode_rate(results: list[RequestResult]) -> float | None:
    """Output tok/s in the first wave's window (module docstring), or None when there is no
    such window (a failed request, or one that finished before the last first token) or it is
    shorter than MIN_WINDOW_STEPS."""
    if not results or not all(r.ok and r.arrivals for r in results):
        return None
    end = min(r.arrivals[-1][0] for r in results)  # the first finish
    wave = [r for r in results if r.start_s < end]
    start = max(r.arrivals[0][0] for r in wave)  # every one of them has its first token
    tpots = sorted(r.tpot_s for r in wave)
    if end - start < tpots[len(tpots) // 2] * MIN_WINDOW_STEPS:
        return None  # a late first token or an early finish: a burst would weigh too much
    tokens = sum(n for r in results for t, n in r.arrivals if start < t <= end)
    return tokens / (end - start)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {f"p{q}": round(percentile(ms, q), 3) for q in QUANTILES}
    out["mean"] = round(sum(ms) / len(ms), 3) if ms else 0.0
    return out


def group_stats(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "ttft_ms": latency_ms([r.ttft_s for r in ok]),
        "tpot_ms": latency_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
        "itl_ms": latency_ms([g for r in ok for g in r.itl_s]),
        "e2e_ms": latency_ms([r.e2e_s for r in ok]),
        "output_tokens": sum(r.output_tokens for r in ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
    }


def summarize_results(results: list[RequestResult], duration_s: float, mode: str,
                      extra: dict[str, Any]) -> dict[str, Any]:
    """All figures of one load point as one JSON-able dict (what `--json` prints)."""
    stats = group_stats(results)
    duration_s = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(stats["completed"] / duration_s, 3),
        "output_throughput": round(stats["output_tokens"] / duration_s, 3),
        "total_token_throughput": round((stats["output_tokens"] + stats["prompt_tokens"])
                                        / duration_s, 3),
        **stats,
        "mode": mode,
        "decode_throughput": None if (rate := wave_decode_rate(results)) is None
        else round(rate, 3),
        **extra,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    kinds = sorted({r.kind for r in results})
    if kinds == ["long", "short"] or kinds == ["short", "long"]:
        summary["groups"] = {k: group_stats([r for r in results if r.kind == k])
                             for k in ("short", "long")}
    return summary


def _lat(name: str, d: dict[str, float]) -> str:
    return (f"{name:<10} p50 {d['p50']:9.2f}  p90 {d['p90']:9.2f}  p95 {d['p95']:9.2f}  "
            f"p99 {d['p99']:9.2f}  mean {d['mean']:9.2f}")


def format_summary(s: dict[str, Any]) -> str:
    """One load point, for a person."""
    lines = [
        f"requests: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s "
        f"({s['mode']})",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output "
        f"tok/s, {s['total_token_throughput']:.1f} total tok/s",
        _lat("TTFT ms", s["ttft_ms"]), _lat("TPOT ms", s["tpot_ms"]), _lat("ITL ms", s["itl_ms"]),
        _lat("E2E ms", s["e2e_ms"]),
    ]
    for kind, g in s.get("groups", {}).items():
        if not g["completed"]:  # percentiles of nothing would print as 0.00 ms
            lines.append(f"[{kind}] 0 ok, {g['failed']} failed: no latencies")
            continue
        lines.append(f"[{kind}] {g['completed']} ok, {g['failed']} failed")
        lines += [f"  {_lat(n, g[k])}" for n, k in (("TTFT ms", "ttft_ms"), ("ITL ms", "itl_ms"),
                                                   ("E2E ms", "e2e_ms"))]
    if "spec_mean_accepted_length" in s:
        lines.append(f"speculative: mean accepted length {s['spec_mean_accepted_length']:.2f} "
                     "tokens per verify step")
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def format_sweep(points: list[dict[str, Any]]) -> str:
    """A sweep, one row per load point."""
    head = (f"{'load':<14} {'ok':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>9}")
    rows = [head, "-" * len(head)]
    for s in points:
        rows.append(f"{s['mode']:<14} {s['completed']:>5} {s['request_throughput']:>7.2f} "
                    f"{s['output_throughput']:>10.1f} {s['ttft_ms']['p50']:>9.2f} "
                    f"{s['ttft_ms']['p99']:>9.2f} {s['tpot_ms']['p50']:>9.2f} "
                    f"{s['itl_ms']['p50']:>8.2f} {s['itl_ms']['p99']:>8.2f} "
                    f"{s['e2e_ms']['p50']:>9.2f}")
    rows.append("(latencies in ms)")
    for s in points:
        rows += [f"error ({s['mode']}): {e}" for e in s["errors"]]
    return "\n".join(rows)
