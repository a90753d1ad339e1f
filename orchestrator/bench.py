"""`tandem bench`: a synthetic serving workload against any OpenAI-compatible server.

Each request streams `/v1/completions` with `ignore_eos: true` and `max_tokens = output_len`,
so its output length is exact. Prompts are random text (characters drawn from letters and
digits, which every tokenizer can encode; one character is one token with the embedded
character-level tokenizer) or random token-id lists (`--prompt-kind ids`, exact lengths on
servers that accept token-id prompts).

Arrivals: a closed loop of `concurrency` requests in flight, or an open loop at a Poisson
`request_rate` (seeded). Mixed load (`long_every K`): every K-th request has a long prompt
(`long_input_len`), so long prefills arrive while short requests decode. Statistics are
reported for all requests and, in mixed load, for the short and long ones separately — the
short requests' inter-token latency is the figure PD disaggregation should keep steady.

Measured per request: TTFT (send → first streamed text), ITL (gaps between later streamed
chunks), end-to-end latency, output tokens (usage.completion_tokens when the server streams
usage, else one per chunk).
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.client import ServerError, error_text, first_model, make_client

_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class BenchSpec:
    input_len: int = 128
    output_len: int = 32
    num_requests: int = 64
    concurrency: int = 0  # closed loop when > 0
    request_rate: float = 0.0  # open loop (Poisson, requests/s) when > 0
    seed: int = 0
    prompt_kind: str = "text"  # text | ids
    vocab_size: int = 32  # ids: prompt token ids are drawn from [1, vocab_size)
    long_every: int = 0  # mixed load: every K-th request is long (0 = off)
    long_input_len: int = 1024
    model: str = ""  # "" = the first model of /v1/models
    api_key: str = ""
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    kind: str  # short | long
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0  # from usage when the server streams it, else 0


def make_prompts(spec: BenchSpec) -> list[tuple[str, Any]]:
    """(kind, prompt) per request, deterministic in spec.seed."""
    rng = random.Random(spec.seed)
    out: list[tuple[str, Any]] = []
    for i in range(spec.num_requests):
        long = spec.long_every > 0 and i % spec.long_every == spec.long_every - 1
        n = spec.long_input_len if long else spec.input_len
        if spec.prompt_kind == "ids":
            prompt: Any = [rng.randrange(1, spec.vocab_size) for _ in range(n)]
        else:
            prompt = "".join(rng.choice(_ALPHABET) for _ in range(n))
        out.append(("long" if long else "short", prompt))
    return out


def arrival_times(spec: BenchSpec) -> list[float]:
    """Send offsets in seconds: all 0 in a closed loop; Poisson gaps at request_rate."""
    if spec.request_rate <= 0:
        return [0.0] * spec.num_requests
    rng = random.Random(spec.seed + 1)
    t, out = 0.0, []
    for _ in range(spec.num_requests):
        out.append(t)
        t += rng.expovariate(spec.request_rate)
    return out


async def _stream_one(client: httpx.AsyncClient, body: dict[str, Any], res: RequestResult) -> None:
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = error_text(resp)
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {msg['error'].get('message', msg['error'])}"
                    return
                usage = msg.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                if not any(c.get("text") for c in msg.get("choices") or []):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return
    if chunks == 0:
        res.error = "the stream carried no text"
        return
    res.e2e_s = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True


async def run_bench(url: str, spec: BenchSpec) -> tuple[list[RequestResult], float]:
    """Run the workload; (per-request results, wall duration in seconds)."""
    prompts = make_prompts(spec)
    offsets = arrival_times(spec)
    width = spec.concurrency if spec.concurrency > 0 else spec.num_requests
    sem = asyncio.Semaphore(width)
    async with make_client(url, spec.api_key, spec.timeout_s, min(width, 256)) as client:
        model = spec.model or await first_model(client)
        results = [RequestResult(kind) for kind, _ in prompts]
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the open loop's arrival schedule, not a readiness wait
            body = {"model": model, "prompt": prompts[i][1], "max_tokens": spec.output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                await _stream_one(client, body, results[i])

        await asyncio.gather(*(one(i) for i in range(spec.num_requests)))
        return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _latency(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    return {"p50": round(percentile(ms, 50), 3), "p99": round(percentile(ms, 99), 3),
            "mean": round(sum(ms) / len(ms), 3) if ms else 0.0}


def _group_stats(results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "ttft_ms": _latency([r.ttft_s for r in ok]),
        "itl_ms": _latency([g for r in ok for g in r.itl_s]),
        "e2e_ms": _latency([r.e2e_s for r in ok]),
        "output_tokens": sum(r.output_tokens for r in ok),
    }


def summarize(results: list[RequestResult], duration_s: float, spec: BenchSpec) -> dict[str, Any]:
    """All figures as one JSON-able dict (what `--json` prints)."""
    stats = _group_stats(results)
    duration_s = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "duration_s": round(duration_s, 3),
        "request_throughput": round(stats["completed"] / duration_s, 3),
        "output_throughput": round(stats["output_tokens"] / duration_s, 3),
        **stats,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "mode": f"rate {spec.request_rate:g}/s" if spec.request_rate > 0 else f"concurrency {spec.concurrency or len(results)}",
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if spec.long_every > 0:
        summary["groups"] = {kind: _group_stats([r for r in results if r.kind == kind]) for kind in ("short", "long")}
    return summary


def format_summary(s: dict[str, Any]) -> str:
    def lat(name: str, d: dict[str, float]) -> str:
        return f"{name:<10} p50 {d['p50']:9.2f}  p99 {d['p99']:9.2f}  mean {d['mean']:9.2f}"

    lines = [
        f"requests: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s ({s['mode']})",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s",
        lat("TTFT ms", s["ttft_ms"]), lat("ITL ms", s["itl_ms"]), lat("E2E ms", s["e2e_ms"]),
    ]
    for kind, g in s.get("groups", {}).items():
        lines.append(f"[{kind}] {g['completed']} ok, {g['failed']} failed")
        lines += [f"  {lat('TTFT ms', g['ttft_ms'])}", f"  {lat('ITL ms', g['itl_ms'])}", f"  {lat('E2E ms', g['e2e_ms'])}"]
    if "spec_mean_accepted_length" in s:
        lines.append(f"speculative: mean accepted length {s['spec_mean_accepted_length']:.2f} "
                     "tokens per verify step")
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def spec_totals(url: str, api_key: str = "") -> tuple[float, float]:
    """(accepted draft tokens, request verify steps) summed over the gateway's workers, from
    its /metrics (speculative decoding's tandem_spec_* series); (0, 0) without speculation."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return 0.0, 0.0
    if r.status_code != 200:  # another server, or metrics behind an admin key: no figure
        return 0.0, 0.0
    accepted = steps = 0.0
    try:
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name == "tandem_spec_accepted_tokens_total":
                    accepted += sample.value
                elif sample.name == "tandem_spec_accepted_length_count":
                    steps += sample.value
    except ValueError:  # not Prometheus text
        return 0.0, 0.0
    return accepted, steps


def bench_main(url: str, spec: BenchSpec, as_json: bool, out: IO[str], err: IO[str]) -> int:
    """Run and print; 0 when every request completed, 1 otherwise, 2 if the server is unreachable."""
    before = spec_totals(url, spec.api_key)
    try:
        results, duration = asyncio.run(run_bench(url, spec))
    except ServerError as exc:
        print(f"error: {exc}", file=err)
        return 2
    summary = summarize(results, duration, spec)
    time.sleep(0.6)  # the gateway's GetLoad refresh (gateway.load_interval_s) catches up
    accepted, steps = (a - b for a, b in zip(spec_totals(url, spec.api_key), before, strict=True))
    if steps > 0:  # tokens per verify step: accepted drafts + the one every step emits
        summary["spec_mean_accepted_length"] = round((accepted + steps) / steps, 3)
    print(json.dumps(summary) if as_json else format_summary(summary), file=out)
    return 0 if summary["failed"] == 0 else 1
