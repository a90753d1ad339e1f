"""1P1D vs mono: the same `tandem bench` concurrency sweep against both clusters, one run.

    .venv/bin/python -m bench.pd_vs_mono                       # the dev box: embedded model
    bash bench/device/run.sh s                                 # one H200: the same, 8B shape
    .venv/bin/python -m bench.pd_vs_mono --plot-only docs/img/bench-h200   # its plots, here

On the H200 (`run.sh s`) both workers share GPU 0 (cuda_ipc), 8B-shape dummy weights, and the
plots are drawn afterwards where matplotlib is installed (`--plot-only DIR` reads bench.json).
Starts each cluster in turn (`tandem serve` in the background on free ports), sweeps it with
the same load points and prompts, stops it, then writes `bench.json` (both runs, every point,
raw samples), `latency_throughput.png` and `itl_cdf.png` comparing the two into --out, and
prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.bench import BenchSpec, run_point  # noqa: E402
from orchestrator.bench_plot import plot_runs  # noqa: E402
from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster  # noqa: E402


def plot(out: Path, runs: dict[str, list[dict[str, Any]]], spec: dict[str, Any]) -> None:
    plot_runs(runs, out, title=f"1P1D vs mono, {spec['input_len']}-token prompts, "
                               f"{spec['output_len']} new tokens")


def sweep(config: str, model: Path, sets: list[str], spec: BenchSpec,
          concurrency: list[int]) -> list[dict[str, Any]]:
    points = []
    with tempfile.TemporaryDirectory() as tmp, \
            running_cluster(config, *sets, tmp=Path(tmp), model=model, ready_timeout_s=900) as c:
        for conc in concurrency:
            summary, samples = run_point(c.url, dataclasses.replace(spec, concurrency=conc),
                                         sys.stderr)
            points.append({**summary, "samples": samples})
            print(f"{config} c={conc}: {summary['output_throughput']:.1f} tok/s, ITL p50/p99 "
                  f"{summary['itl_ms']['p50']:.2f}/{summary['itl_ms']['p99']:.2f} ms",
                  file=sys.stderr)
    return points


def markdown(runs: dict[str, list[dict[str, Any]]]) -> str:
    rows = ["| cluster | c | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | "
            "ITL p50 / p99 ms | E2E p50 ms | failed |", "|---|---|---|---|---|---|---|---|"]
    for label, points in runs.items():
        for p in points:
            rows.append(f"| {label} | {p['concurrency']} | {p['output_throughput']:.1f} | "
                        f"{p['ttft_ms']['p50']:.1f} / {p['ttft_ms']['p99']:.1f} | "
                        f"{p['tpot_ms']['p50']:.2f} | {p['itl_ms']['p50']:.2f} / "
                        f"{p['itl_ms']['p99']:.2f} | {p['e2e_ms']['p50']:.1f} | {p['failed']} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pd", default="configs/tiny-1p1d.yaml")
    ap.add_argument("--mono", default="configs/tiny-mono.yaml")
    ap.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--pd-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--mono-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--plot-only", type=Path, metavar="DIR", help="redraw DIR/bench.json's plots")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "bench-cpu")
    ap.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                    help="ids: random token-id prompts (a model without a tokenizer, e.g. the "
                    "8B-shape dummy)")
    ap.add_argument("--vocab-size", type=int, default=32,
                    help="with --prompt-kind ids: ids are drawn below this")
    args = ap.parse_args()
    if args.plot_only:
        data = json.loads((args.plot_only / "bench.json").read_text())
        plot(args.plot_only, data["runs"], data["spec"])
        print(markdown(data["runs"]))
        return 0
    concurrency = [int(c) for c in args.concurrency.split(",")]
    spec = BenchSpec(input_len=args.input_len, output_len=args.output_len,
                     num_requests=args.num_requests, prompt_kind=args.prompt_kind,
                     vocab_size=args.vocab_size)
    runs = {"mono": sweep(args.mono, args.model, [*args.sets, *args.mono_set], spec, concurrency),
            "1P1D": sweep(args.pd, args.model, [*args.sets, *args.pd_set], spec, concurrency)}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": date.today().isoformat(), "machine": platform.node(), "pd": args.pd,
            "mono": args.mono, "model": str(args.model), "sets": args.sets,
            "spec": dataclasses.asdict(spec)}
    (args.out / "bench.json").write_text(json.dumps({**meta, "runs": runs}))  # compact
    print(markdown(runs))
    try:
        plot(args.out, runs, meta["spec"])
    except ModuleNotFoundError as exc:  # the GPU machine may lack matplotlib: plot elsewhere
        print(f"no plots ({exc}); run: python -m bench.pd_vs_mono --plot-only {args.out}",
              file=sys.stderr)
    empty = [f"{name} c={r['concurrency']}: {(r.get('errors') or ['no answer'])[0]}"
             for name, rs in runs.items() for r in rs if not r.get("completed")]
    for line in empty:  # a point where nothing answered is a broken run, not a figure
        print(f"error: {line}", file=sys.stderr)
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
