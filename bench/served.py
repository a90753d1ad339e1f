"""Served / engine: what clients receive against what the engine makes, in one process.

    python -m bench.served                       # GPU: 8B-shape Qwen3 (dummy, bf16), B = 16 64 160
    python -m bench.served --smoke               # CPU: the embedded model, small B (4 16)
    python -m bench.served --batches 16,64 --input-len 128 --output-len 256

For every batch size B, with the same prompt and output lengths (ignore_eos, greedy):
1. the engine in-process (worker/engine.py, no gRPC, gateway or HTTP) running K x B requests
   (--waves K, default 2) at max_num_seqs = B, as a closed loop of B would, after a warm pass
   of B short requests: output tok/s over the whole run, its decode rate (tokens while every
   request of the first wave has its first token and none has finished / that time) — the
   rate a decode worker alone would reach at batch B — and its step times by kind (decode
   steps, and mixed steps by their prompt tokens);
2. the served clusters (`tandem serve` in the background, started together on the same
   device): mono (`role: both`) and 1P1D, `tandem bench` at concurrency B with K x B requests,
   from --clients load-generator processes (4 on the GPU: one caps the rate at B = 160):
   output tok/s, ITL p50 / p99;
and prints served / engine (mono against the whole engine rate, 1P1D against the decode
rate: its decode worker only decodes). Equal lengths make a closed loop run in waves (B
requests start, prefill and finish together); --range-ratio R spreads each length over
[L(1-R), L(1+R)] for a steady load. Writes served.json and served.md to --out ($OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

from bench.gpu_pd import SHAPE_8B, clusters_at_once, word_level_model
from orchestrator.bench import BenchSpec, load, summarize
from orchestrator.config import load_config
from orchestrator.launch.background import EMBEDDED_MODEL, REPO
from orchestrator.worker_config import worker_config


def engine_rates(config: str, sets: list[str], batch: int, work: list[tuple[list[int], int]],
                 trace: tuple[int, Path] | None = None) -> dict[str, Any]:
    """The in-process engine over `work` ((prompt ids, output tokens) per request) at
    max_num_seqs = batch (same config as served). `trace` = (N, dir): torch.profiler over N
    steps from step 150 on (device_steps.txt there: each kind's wall and kernel time)."""
    import torch

    from orchestrator.bench_stats import latency_ms, token_latencies
    from worker.engine import Engine, RequestOutput
    from worker.request import Request
    from worker.sampling import SamplingParams

    cluster = load_config(REPO / config, [*sets, f"scheduler.max_num_seqs={batch}"])
    engine = Engine(worker_config(cluster, "both"))
    engine.warm_up()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    later: list[tuple[float, int]] = []  # (time, tokens) of every output after a first token
    arrivals: dict[str, list[tuple[float, int]]] = {}  # per request, as a client reads them

    def sink(out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            arrivals.setdefault(out.request_id, []).append((now, len(out.token_ids)))
        if out.token_ids and out.request_id not in first:
            first[out.request_id] = now
            later.append((now, len(out.token_ids) - 1))
        elif out.token_ids:
            later.append((now, len(out.token_ids)))
        if out.finished:
            done[out.request_id] = now

    # A warm load first, as the served clusters get one: the mixed steps' kernels (Triton
    # compiles each new specialization on first use) are compiled before the clock starts.
    # Reversed prompts: the same shapes, and no prefix-cache hit for the timed run.
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, (p, _) in enumerate(work[:batch]):
        engine.submit(Request(f"w{i}", p[::-1], warm), sink)
    while len(done) < min(batch, len(work)):
        engine.step()
    first.clear()
    done.clear()
    later.clear()
    arrivals.clear()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(work):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.submit(Request(f"e{i}", list(p), params), sink)
    steps: list[tuple[bool, float, int]] = []  # (overlapped, seconds, prompt tokens)
    sched = engine.scheduler
    window = range(150, 150 + trace[0]) if trace else range(0)
    prof = torch.profiler.profile() if trace else None
    while len(done) < len(work):
        if prof is not None and len(steps) in (window.start, window.stop):
            prof.start() if len(steps) == window.start else prof.stop()
        before, t = engine.num_overlapped_steps, time.perf_counter()
        prompt_before = sched.prompt_tokens_computed
        with torch.profiler.record_function("tandem_step"):
            engine.step()
        steps.append((engine.num_overlapped_steps > before, time.perf_counter() - t,
                      sched.prompt_tokens_computed - prompt_before))
    wall = time.perf_counter() - t0
    if prof is not None and trace is not None and len(steps) >= window.stop:
        device_steps(prof, steps[window.start : window.stop], trace[1])
    # The decode rate: while every request of the first wave (the first B, admitted together)
    # has its first token and none has finished, every step is a decode at batch B.
    wave = [f"e{i}" for i in range(min(batch, len(work)))]
    t_from, t_to = max(first[r] for r in wave), min(done[r] for r in wave)
    decode_tokens = sum(n for t, n in later if t_from < t <= t_to)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    itl = [x for a in arrivals.values() for x in token_latencies(a[0][0], a)[1]]
    return {"output_tok_s": round(sum(n for _, n in work) / wall, 1),
            "decode_tok_s": round(decode_tokens / max(t_to - t_from, 1e-9), 1),
            "itl_ms": latency_ms(itl), "steps": step_times(steps)}


def device_steps(prof: Any, steps: list[tuple[bool, float, int]], out: Path) -> None:
    """Each profiled step's kernel time (its launches' device time) beside its wall time, by
    kind, and the kernels that took the most device time, into out/device_steps.txt."""
    from orchestrator.bench_stats import percentile

    marks = sorted((e for e in prof.events() if e.name == "tandem_step"),
                   key=lambda e: e.time_range.start)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for (overlapped, seconds, prompt), mark in zip(steps, marks, strict=False):
        kind = ("mixed" if prompt else "decode") + ("" if overlapped else " (plain)")
        kinds.setdefault(kind, []).append((seconds * 1e3, mark.device_time_total / 1e3))
    lines = [f"{len(marks)} profiled steps (wall: the step call; device: its launches' kernels)"]
    for kind, rows in kinds.items():
        walls, devs = [w for w, _ in rows], [d for _, d in rows]
        lines.append(f"{kind}: n={len(rows)} wall p50 {percentile(walls, 50):.2f} ms, device "
                     f"p50 {percentile(devs, 50):.2f} ms, mean {sum(devs) / len(devs):.2f} ms")
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    (out / "device_steps.txt").write_text("\n".join(lines) + "\n\n" + table)
    print("\n".join(lines), flush=True)


def step_times(steps: list[tuple[bool, float, int]]) -> dict[str, Any]:
    """The timed run's engine steps by what they ran, each kind's count and p50 / p99 in ms:
    decodes (no prompt token) and mixed steps (decodes and prompt chunks), those also by how
    many prompt tokens they ran, which shows whether a mixed step costs its prompts' compute or
    a fixed price; `plain` counts the steps that were not overlapped. An overlapped step's call
    returns once the in-flight step before it is done on the device, so its time is that step's
    (filed under that step's kind; none after a plain step); a plain step's call runs it to
    the end."""
    from orchestrator.bench_stats import percentile

    kinds: dict[str, list[float]] = {"decode": [], "mixed": []}
    edges = (0, 64, 128, 256, 512)
    for i, (overlapped, seconds, prompt) in enumerate(steps):
        if overlapped:  # it waited for the step before it, if that one was in flight too
            if i == 0 or not steps[i - 1][0]:
                continue
            prompt = steps[i - 1][2]
        kinds["mixed" if prompt else "decode"].append(seconds * 1e3)
        if prompt:
            lo = max((e for e in edges if e < prompt), default=-1)
            hi = min((e for e in edges if e >= prompt), default=None)
            name = f"mixed {lo + 1}-{hi}" if hi is not None else f"mixed >{edges[-1]}"
            kinds.setdefault(name, []).append(seconds * 1e3)
    out = {kind: {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2),
                  "p99_ms": round(percentile(ms, 99), 2)} for kind, ms in kinds.items()}
    out["plain"] = {"n": sum(not overlapped for overlapped, _, _ in steps)}
    return out


def work_for(spec: BenchSpec) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of each request the served run sends: its ids prompts, or
    the embedded tokenizer's ids of its text prompts."""
    from gateway.tokenizer import Tokenizer
    from orchestrator.bench import make_sessions

    sessions = make_sessions(spec)
    prompts = [s.prompt(0, "") for s in sessions]
    if not all(isinstance(p, list) for p in prompts):
        tok = Tokenizer.from_dir(str(EMBEDDED_MODEL))  # text prompts: the served path's ids
        prompts = [tok.encode(p) for p in prompts]
    return [(p, s.max_tokens) for p, s in zip(prompts, sessions, strict=True)]


def profiler(cluster: Any, seconds: float, out: Path, client: bool) -> threading.Thread:
    """py-spy, for `seconds` after the load warms up and all at once, the cluster's mono worker
    (worker_profile.txt), its gateway (gateway_profile.txt) and, with `client`, this process,
    the load generator (client_profile.txt): which of them limits the served rate."""
    from bench.pyspy import pid_listening, record

    ports = {"worker": int(cluster.workers["both-0"].rsplit(":", 1)[1]),
             "gateway": int(cluster.url.rsplit(":", 1)[1])}

    def one(name: str, pid: int | None, what: str) -> None:
        text = record(pid, seconds) if pid else f"no process listens on {what}\n"
        (out / f"{name}_profile.txt").write_text(text)

    def run() -> None:
        time.sleep(2.0)  # into the steady part of the run
        pids = {name: (pid_listening(port), f"port {port}") for name, port in ports.items()}
        if client:
            pids["client"] = (os.getpid(), "")
        spies = [threading.Thread(target=one, args=(n, pid, what))
                 for n, (pid, what) in pids.items()]
        for t in spies:
            t.start()
        for t in spies:
            t.join()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def table(r: dict[str, Any]) -> str:
    lines = [f"### served / engine ({r['date']}, {r['machine']})", "",
             f"{r['input_len']} in / {r['output_len']} out"
             + (f" (each ±{r['range_ratio']:.0%})" if r.get("range_ratio") else "")
             + f", {r.get('waves', 2)}B requests at concurrency B; "
             "engine = in-process at max_num_seqs B; "
             f"{r['clients']} load-generator processes"
             + "".join(f"; --set {kv}" for kv in r["sets"]), "",
             "| B | engine tok/s | engine decode tok/s | engine ITL p50 / p99 ms | mono tok/s | "
             "mono / engine | mono ITL p50 / p99 ms | 1P1D tok/s | 1P1D / engine decode | "
             "1P1D ITL p50 / p99 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b, row in r["rows"].items():
        e, m, p = row.get("engine", {}), row.get("mono", {}), row.get("1P1D", {})

        def ratio(served: dict[str, Any], key: str, e: dict[str, Any] = e) -> str:
            ref = e.get(key, 0)
            return f"{served['output_throughput'] / ref:.2f}" if served and ref else "—"

        def itl(s: dict[str, Any]) -> str:
            return f"{s['itl_ms']['p50']:.2f} / {s['itl_ms']['p99']:.2f}" if s else "—"

        lines.append(f"| {b} | {e.get('output_tok_s', '—')} | {e.get('decode_tok_s', '—')} | "
                     f"{itl(e)} | {m.get('output_throughput', '—')} | "
                     f"{ratio(m, 'output_tok_s')} | {itl(m)} "
                     f"| {p.get('output_throughput', '—')} | {ratio(p, 'decode_tok_s')} | "
                     f"{itl(p)} |")
    lines += [f"error: {e}" for e in r.get("errors", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, the embedded model, small B")
    ap.add_argument("--batches", default="", help="comma-separated B (default 16,64,160; "
                    "smoke 4,16)")
    ap.add_argument("--input-len", type=int, default=0)
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=0, help="8B shape with fewer layers")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the engine and every cluster (repeatable), "
                         "e.g. scheduler.chunked_prefill_size=256")
    ap.add_argument("--waves", type=int, default=2, metavar="K",
                    help="K x B requests per point (default 2)")
    ap.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                    help="each input and output length from [L(1-R), L(1+R)]: a steady load "
                         "rather than waves of requests that start and finish together")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--skip-served", action="store_true", help="only the engine figures")
    ap.add_argument("--clients", type=int, default=0, help="load-generator processes "
                    "(default 4 on the GPU, 1 with --smoke; with 1 the profile covers it too)")
    ap.add_argument("--trace-steps", type=int, default=0, metavar="N",
                    help="torch.profiler over N engine steps at the largest B "
                         "(device_steps.txt in --out)")
    ap.add_argument("--profile-s", type=float, default=0.0, help="py-spy the mono worker, its "
                    "gateway and the load generator this long under a load at the largest B, "
                    "after the measured runs (*_profile.txt in --out)")
    args = ap.parse_args()
    batches = [int(b) for b in (args.batches or ("4,16" if args.smoke else "16,64,160")).split(",")]
    input_len = args.input_len or (32 if args.smoke else 128)
    output_len = args.output_len or (32 if args.smoke else 256)
    max_b = max(batches)
    args.clients = args.clients or (1 if args.smoke else 4)
    kv_tokens = round(max_b * (input_len + output_len) * (1 + args.range_ratio)) + 4096
    common = [f"cache.max_total_tokens={kv_tokens}", f"scheduler.max_num_seqs={max_b}",
              "launcher.ready_timeout_s=900"]
    tmp = Path(tempfile.mkdtemp())
    if args.smoke:
        model, device = EMBEDDED_MODEL, "cpu"
        spec_kw: dict[str, Any] = {"prompt_kind": "text"}
    else:
        model, device = word_level_model(SHAPE_8B, tmp / "model", args.num_layers), "cuda:0"
        common += ["model.load_format=dummy", "model.dtype=bfloat16", "model.max_model_len=4096",
                   # as configs/gpu-8b-mono.yaml: 256-token steps while requests decode (the ITL
                   # p99); --set scheduler.mixed_step_tokens=0 measures the full budget
                   "scheduler.mixed_step_tokens=256"]
        spec_kw = {"prompt_kind": "ids", "vocab_size": 151936}
    common += args.set  # last: they override the defaults above
    mono_sets = [*common, f"roles.both.parallel.device={device}"]
    if args.smoke:  # one torch thread: the gateway and the client need the other core
        mono_sets.append("roles.both.num_threads=1")
    engine_sets = [*mono_sets, f"model.path={model}"]
    pd_threads = ["roles.prefill.num_threads=1", "roles.decode.num_threads=1"] if args.smoke else []
    result: dict[str, Any] = {"date": str(date.today()), "input_len": input_len,
                              "clients": args.clients, "sets": args.set,
                              "range_ratio": args.range_ratio, "waves": args.waves,
                              "output_len": output_len, "rows": {}, "errors": [],
                              "machine": f"{platform.node()}, {os.cpu_count()} cores"}
    args.out.mkdir(parents=True, exist_ok=True)

    def record() -> None:
        (args.out / "served.json").write_text(json.dumps(result, indent=1))
        (args.out / "served.md").write_text(table(result))

    specs = {b: BenchSpec(input_len=input_len, output_len=output_len, num_requests=args.waves * b,
                          concurrency=b, seed=5, clients=args.clients,
                          range_ratio=args.range_ratio, **spec_kw)
             for b in batches}
    for b in batches:
        try:
            trace = (args.trace_steps, args.out) if args.trace_steps and b == max_b else None
            rates = engine_rates("configs/tiny-mono.yaml", engine_sets, b, work_for(specs[b]),
                                 trace)
            result["rows"][str(b)] = {"engine": rates}
        except Exception as exc:  # keep the other rows; the error is in the report
            result["errors"].append(f"engine B={b}: {type(exc).__name__}: {exc}")
        print(f"[served] engine B={b}: {result['rows'].get(str(b))}", flush=True)
        record()
    if not args.skip_served:
        runs = {"mono": ("configs/tiny-mono.yaml", mono_sets),
                "1P1D": ("configs/tiny-1p1d.yaml", [*common, *pd_threads, "transfer.backend=" + (
                    "mooncake" if args.smoke else "cuda_ipc"),
                    f"roles.prefill.parallel.device={device}",
                    f"roles.decode.parallel.device={device}"])}
        warm = BenchSpec(input_len=16, output_len=4, num_requests=8, concurrency=8, **spec_kw)
        with clusters_at_once(runs, tmp, model, 900) as up:
            for name in ("mono", "1P1D"):
                load(up[name].url, warm)
                for b in batches:
                    rs, dur = load(up[name].url, specs[b])
                    s = summarize(rs, dur, specs[b])
                    result["rows"].setdefault(str(b), {})[name] = s
                    print(f"[served] {name} B={b}: {s['output_throughput']} tok/s, ITL "
                          f"{s['itl_ms']}, failed {s['failed']}", flush=True)
                    record()
            if args.profile_s > 0:  # a load of its own, long enough for the record
                row = result["rows"].get(str(max_b), {}).get("engine", {})
                rate = row.get("output_tok_s", 1000.0)
                n = max(2 * max_b, int(rate * (args.profile_s + 6) / output_len))
                prof = profiler(up["mono"], args.profile_s, args.out, args.clients == 1)
                spec = replace(specs[max_b], num_requests=n)
                s = summarize(*load(up["mono"].url, spec), spec)
                prof.join()
                result["profiled"] = s
                print(f"[served] profiled: mono B={max_b}, {args.clients} client processes: "
                      f"{s['output_throughput']} tok/s, ITL {s['itl_ms']}", flush=True)
                record()
    print(table(result))


if __name__ == "__main__":
    main()
