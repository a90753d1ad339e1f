"""`tandem bench`: a serving workload against any OpenAI-compatible server, like vLLM's
`bench serve`, SGLang's `bench_serving` or genai-perf.

Each request streams `/v1/completions` with `ignore_eos: true` and `max_tokens`, so output
lengths are exact, and `return_token_ids: true` (vLLM's field; `--no-token-ids` for a server
that refuses it) so each stream event says how many tokens it carries. What is sent comes
from orchestrator/bench_data.py (random prompts, a JSONL file, or synthetic multi-turn
conversations over shared prefixes); the figures from orchestrator/bench_stats.py (TTFT, TPOT,
per-token ITL from arrival times, E2E; p50/p90/p95/p99).

Load: a closed loop of `concurrency` sessions in flight, or an open loop of Poisson session
arrivals at `request_rate`. A sweep runs one load point after the other (`--concurrency
1,4,16` or `--request-rate 2,4,8`). `--out DIR` writes bench.json and the plots
(orchestrator/bench_plot.py). On a terminal a progress bar shows each point's requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.bench_data import (
    Session,
    arrival_times,
    jsonl_sessions,
    random_sessions,
    shared_prefix_sessions,
)
from orchestrator.bench_procs import LoadError, run_processes, shares
from orchestrator.bench_stats import (
    RequestResult,
    format_summary,
    format_sweep,
    summarize_results,
    token_latencies,
)
from orchestrator.client import ServerError, error_text, first_model, make_client
from orchestrator.progress import Progress


@dataclass(frozen=True)
class BenchSpec:
    """One load point."""

    input_len: int = 128
    output_len: int = 32
    num_requests: int = 64
    concurrency: int = 0  # closed loop when > 0
    request_rate: float = 0.0  # open loop (Poisson, sessions/s) when > 0
    seed: int = 0
    prompt_kind: str = "text"  # text | ids
    vocab_size: int = 32  # ids: prompt token ids are drawn from [1, vocab_size)
    long_every: int = 0  # mixed load: every K-th request is long (0 = off)
    long_input_len: int = 1024
    range_ratio: float = 0.0  # random: lengths drawn from [L(1-r), L(1+r)] (0 = exact)
    model: str = ""  # "" = the first model of /v1/models
    api_key: str = ""
    timeout_s: float = 600.0
    dataset: str = "random"  # random | shared-prefix | jsonl:PATH
    num_turns: int = 3  # shared-prefix: turns per conversation
    num_groups: int = 4  # shared-prefix: distinct system prompts
    prefix_len: int = 512  # shared-prefix: characters of each system prompt
    return_token_ids: bool = True  # count tokens per stream event from `token_ids`
    clients: int = 1  # load-generator processes (orchestrator/bench_procs.py)

    @property
    def mode(self) -> str:
        return (f"rate {self.request_rate:g}/s" if self.request_rate > 0
                else f"concurrency {self.concurrency or self.num_requests}")


def make_sessions(spec: BenchSpec) -> list[Session]:
    """What the run sends, deterministic in spec.seed."""
    if spec.dataset == "shared-prefix":
        return shared_prefix_sessions(max(1, spec.num_requests // spec.num_turns), spec.input_len,
                                      spec.output_len, spec.seed, spec.num_groups,
                                      spec.prefix_len, spec.num_turns)
    if spec.dataset.startswith("jsonl:"):
        return jsonl_sessions(Path(spec.dataset[6:]), spec.output_len, spec.num_requests)
    return random_sessions(spec.num_requests, spec.input_len, spec.output_len, spec.seed,
                           spec.prompt_kind, spec.vocab_size, spec.long_every,
                           spec.long_input_len, spec.range_ratio)


def make_prompts(spec: BenchSpec) -> list[tuple[str, Any]]:
    """(kind, first prompt) per session (the random dataset: one per request)."""
    return [(s.kind, s.prompt(0, "")) for s in make_sessions(spec)]


def _event_tokens(msg: dict[str, Any]) -> tuple[int, str]:
    """(tokens, text) one stream event carries: its `token_ids`, else 1 per event with text."""
    n, text = 0, ""
    for c in msg.get("choices") or []:
        piece = c.get("text") or ""
        text += piece
        ids = c.get("token_ids")
        n += len(ids) if isinstance(ids, list) else (1 if piece else 0)
    return n, text


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], res: RequestResult) -> None:
    """Send one streaming request; fill `res` from the arrival time of each network read."""
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (read time, tokens in it)
    buf = b""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = error_text(resp)
                return
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                *events, buf = (buf + raw).replace(b"\r\n", b"\n").split(b"\n\n")
                tokens = 0
                for event in events:
                    for line in event.decode().splitlines():
                        data = line[5:].strip() if line.startswith("data:") else ""
                        if not data or data == "[DONE]":
                            continue
                        msg = json.loads(data)
                        if "error" in msg:
                            res.error = f"stream error: {msg['error'].get('message', msg['error'])}"
                            return
                        if usage := msg.get("usage"):
                            res.output_tokens = int(usage.get("completion_tokens") or 0)
                            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        n, text = _event_tokens(msg)
                        tokens += n
                        res.text += text
                if tokens:
                    arrivals.append((now, tokens))
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return
    if not arrivals:
        res.error = "the stream carried no tokens"
        return
    res.ttft_s, res.itl_s = token_latencies(start, arrivals)
    res.start_s, res.arrivals = start, arrivals
    res.e2e_s = arrivals[-1][0] - start
    res.output_tokens = res.output_tokens or sum(n for _, n in arrivals)
    res.ok = True


def load(url: str, spec: BenchSpec, progress_to: IO[str] | None = None,
         results: list[RequestResult] | None = None) -> tuple[list[RequestResult], float]:
    """Run one load point from this process, or from spec.clients processes. `results`, when
    given, fills as requests finish in this process (what a Ctrl-C reports as done)."""
    width = spec.concurrency if spec.concurrency > 0 else spec.num_requests
    n = max(1, min(spec.clients, width, spec.num_requests))
    if n == 1:
        return asyncio.run(run_bench(url, spec, progress_to, results=results))
    return run_processes(_run_share, (url, spec), n)


def _run_share(url: str, spec: BenchSpec, k: int, n: int, ready: Callable[[], None]
               ) -> tuple[list[RequestResult], float]:
    """Process k of n's part of the point (bench_procs runs it in each process)."""
    return asyncio.run(run_bench(url, spec, share=(k, n), ready=ready))


async def run_bench(url: str, spec: BenchSpec, progress_to: IO[str] | None = None,
                    share: tuple[int, int] = (0, 1), ready: Callable[[], None] | None = None,
                    results: list[RequestResult] | None = None
                    ) -> tuple[list[RequestResult], float]:
    """Run one load point; (per-request results, wall duration in seconds). `share` (k, n):
    only sessions k, k+n, ... with 1/n of the concurrency; `ready` is called once the client is
    set up, before the clock starts (bench_procs starts its processes together there);
    `results` is filled in place when given."""
    k, n = share
    everyone = make_sessions(spec)
    offsets = arrival_times(len(everyone), spec.request_rate, spec.seed)[k::n]
    sessions = everyone[k::n]
    width = spec.concurrency if spec.concurrency > 0 else len(everyone)
    width = shares(width, n)[k]
    sem = asyncio.Semaphore(width)
    total = sum(len(s.turns) for s in sessions)
    bar = Progress(total, spec.mode, progress_to)
    results = [] if results is None else results
    async with make_client(url, spec.api_key, spec.timeout_s, min(width, 256)) as client:
        model = await first_model(client, spec.model)
        if ready is not None:
            ready()
        t0 = time.perf_counter()

        async def session(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # the open loop's arrival schedule, not a readiness wait
            s = sessions[i]
            async with sem:
                history = ""
                for turn in range(len(s.turns)):
                    res = RequestResult(s.kind)
                    results.append(res)
                    body: dict[str, Any] = {
                        "model": model, "prompt": s.prompt(turn, history),
                        "max_tokens": s.max_tokens, "temperature": 0.0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                    if spec.return_token_ids:
                        body["return_token_ids"] = True
                    await stream_one(client, body, res)
                    bar.advance(res.ok)
                    if not res.ok:
                        break
                    if isinstance(s.turns[turn], str):
                        history += f"{s.turns[turn]}{res.text}\n"

        try:
            await asyncio.gather(*(session(i) for i in range(len(sessions))))
        finally:
            bar.close()
        return results, time.perf_counter() - t0


def summarize(results: list[RequestResult], duration_s: float, spec: BenchSpec) -> dict[str, Any]:
    """All figures of one load point as one JSON-able dict."""
    extra = {"input_len": spec.input_len, "output_len": spec.output_len,
             "dataset": spec.dataset, "concurrency": spec.concurrency,
             "request_rate": spec.request_rate, "range_ratio": spec.range_ratio}
    return summarize_results(results, duration_s, spec.mode, extra)


def spec_totals(url: str, api_key: str = "") -> tuple[float, float]:
    """(accepted draft tokens, request verify steps) summed over the gateway's workers, from
    its /metrics (speculative decoding's tandem_spec_* series); (0, 0) without speculation or
    on a server with no such page."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return 0.0, 0.0
    if resp.status_code != 200:
        return 0.0, 0.0
    accepted = steps = 0.0
    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                if sample.name == "tandem_spec_accepted_tokens_total":
                    accepted += sample.value
                elif sample.name == "tandem_spec_accepted_length_count":
                    steps += sample.value
    except ValueError:  # not Prometheus text: another server's page
        return 0.0, 0.0
    return accepted, steps


def run_point(url: str, spec: BenchSpec, err: IO[str],
              partial: list[RequestResult] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One load point: (summary, raw samples for plots); `partial` fills as requests finish."""
    before = spec_totals(url, spec.api_key)
    results, duration = load(url, spec, progress_to=err, results=partial)
    summary = summarize(results, duration, spec)
    time.sleep(0.6)  # the gateway's GetLoad refresh (gateway.load_interval_s) catches up
    accepted, steps = (a - b for a, b in zip(spec_totals(url, spec.api_key), before, strict=True))
    if steps > 0:  # tokens per verify step: accepted drafts + the one every step emits
        summary["spec_mean_accepted_length"] = round((accepted + steps) / steps, 3)
    ok = [r for r in results if r.ok]
    samples = {"itl_ms": [round(g * 1000, 4) for r in ok for g in r.itl_s],
               "ttft_ms": [round(r.ttft_s * 1000, 4) for r in ok]}
    return summary, samples


def bench_main(url: str, spec: BenchSpec | list[BenchSpec], as_json: bool, out: IO[str],
               err: IO[str], out_dir: Path | None = None) -> int:
    """Run every load point and print; 0 when every request completed, 1 otherwise (an
    all-failed point prints its errors, not a table of zeros), 2 if the server is unreachable."""
    specs = spec if isinstance(spec, list) else [spec]
    points: list[dict[str, Any]] = []
    for i, s in enumerate(specs):
        partial: list[RequestResult] = []
        try:
            summary, samples = run_point(url, s, err, partial)
        except KeyboardInterrupt:
            return _interrupted(points, specs, i, partial, as_json, out, err, out_dir)
        except ServerError as exc:
            print(f"error: {exc}", file=err)
            return 2
        except LoadError as exc:
            print(f"error: {exc}", file=err)
            return 1
        if summary["completed"] == 0:
            print(f"error: all {summary['num_requests']} requests failed ({s.mode}):", file=err)
            for e in summary["errors"]:
                print(f"error: {e}", file=err)
            if as_json:
                print(json.dumps(summary), file=out)
            return 1
        points.append({**summary, "samples": samples})
    public = [{k: v for k, v in p.items() if k != "samples"} for p in points]
    if as_json:
        print(json.dumps(public[0] if len(public) == 1 else public), file=out)
    else:
        print(format_summary(public[0]) if len(public) == 1 else format_sweep(public), file=out)
    if out_dir is not None:
        try:
            from orchestrator.bench_plot import plot_runs, write_json

            meta = {"url": url, "spec": dataclasses.asdict(specs[0]) | {"api_key": ""}}
            paths = [write_json(out_dir, points, meta), *plot_runs({url: points}, out_dir)]
        except KeyboardInterrupt:
            print(f"interrupted: every load point finished (above); {out_dir} may lack "
                  "bench.json or a plot", file=err)
            return EXIT_INTERRUPTED
        print(f"wrote {', '.join(str(p) for p in paths)}", file=err)
    return 0 if all(p["failed"] == 0 for p in points) else 1


EXIT_INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


def _interrupted(points: list[dict[str, Any]], specs: list[BenchSpec], i: int,
                 partial: list[RequestResult], as_json: bool, out: IO[str], err: IO[str],
                 out_dir: Path | None) -> int:
    """Ctrl-C during load point i: the finished points' table, then one line of what was done."""
    public = [{k: v for k, v in p.items() if k != "samples"} for p in points]
    if public:
        print(json.dumps(public) if as_json else format_sweep(public), file=out)
    s = specs[i]
    total = sum(len(session.turns) for session in make_sessions(s))
    ended = [r for r in partial if r.ok or r.error]  # the rest were cut off in flight
    done = (f"{len(ended)} of {total} requests finished ({sum(not r.ok for r in ended)} "
            f"failed, {len(partial) - len(ended)} cut off)" if s.clients == 1 else
            f"{total} requests over {s.clients} load-generator processes (finished: not counted)")
    kept = "; nothing written to --out" if out_dir is not None else ""
    print(f"interrupted: load point {i + 1} of {len(specs)} ({s.mode}), {done}; "
          f"{len(points)} point(s) finished{' above' if points else ''}{kept}", file=err)
    return EXIT_INTERRUPTED
