"""Served / engine: what clients receive against what the engine makes, in one process, for
mono and 1P1D side by side (`tandem bench --config X.yaml` measures one config's cluster).

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
from orchestrator.bench_engine import engine_rates, work_for
from orchestrator.config import load_config
from orchestrator.launch.background import EMBEDDED_MODEL, REPO
from orchestrator.worker_config import worker_config


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
            sized = load_config(REPO / "configs/tiny-mono.yaml",
                                [*engine_sets, f"scheduler.max_num_seqs={b}"])
            rates = engine_rates(worker_config(sized, "both"),
                                 work_for(specs[b], str(EMBEDDED_MODEL)), trace)
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
