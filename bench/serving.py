"""Serving benchmarks on this machine, each comparison measured in one run.

    python -m bench.serving mono-vs-hf   # issue 2: tandem bench on the mono cluster (c=1, c=16),
                                         #          our engine in-process, and transformers
                                         #          generate (batch 1, batch 16)
    python -m bench.serving pd-vs-mono   # issue 4: a mixed load (long prompts arriving while
                                         #          short requests decode), 1P1D vs mono

Each prints a markdown table to paste into docs/benchmarks.md, and `--json` writes raw figures.
Clusters are real (`tandem serve` in the background on free ports, the embedded model unless
--model says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from orchestrator.bench import BenchSpec, run_bench, summarize
from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster


def bench(url: str, spec: BenchSpec) -> dict[str, Any]:
    results, duration = asyncio.run(run_bench(url, spec))
    return summarize(results, duration, spec)


def hf_generate_tps(
    model_dir: Path, batch: int, input_len: int, output_len: int, threads: int
) -> float:
    """Output tokens/s of transformers' generate (greedy, eager) at `batch`, same lengths."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(
        4, min(vocab, 60), (batch, input_len), generator=torch.Generator().manual_seed(0)
    )
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        return batch * output_len / (time.perf_counter() - t0)


def engine_tps(model_dir: Path, batch: int, input_len: int, output_len: int, threads: int) -> float:
    """Output tokens/s of our engine in-process (no gRPC, no gateway, no HTTP), same lengths."""
    import torch

    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine, RequestOutput
    from worker.request import Request
    from worker.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(
        WorkerConfig(
            model=ModelConfig(path=str(model_dir)),
            cache=CacheConfig(max_total_tokens=batch * (input_len + output_len) + 1024),
            scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), chunked_prefill_size=2048),
        )
    )
    engine.warm_up()
    finished: list[str] = []

    def sink(out: RequestOutput) -> None:
        if out.finished:
            finished.append(out.request_id)

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(batch):
        engine.submit(Request(f"b{i}", [4 + (i + j) % 50 for j in range(input_len)], params), sink)
    while len(finished) < batch:
        engine.step()
    return batch * output_len / (time.perf_counter() - t0)


def machine() -> str:
    return (
        f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}"
    )


def mono_vs_hf(args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_cluster(
            "configs/tiny-mono.yaml",
            f"roles.both.num_threads={args.threads}",
            tmp=Path(tmp),
            model=args.model,
        ) as c,
    ):
        for conc in (1, 16):
            spec = BenchSpec(
                input_len=args.input_len,
                output_len=args.output_len,
                num_requests=max(8, conc * 4),
                concurrency=conc,
                seed=1,
            )
            bench(
                c.url, BenchSpec(input_len=16, output_len=4, num_requests=4, concurrency=4)
            )  # warm-up
            rows[f"tandem c={conc}"] = bench(c.url, spec)
    for batch in (1, 16):
        rows[f"transformers b={batch}"] = {
            "output_throughput": hf_generate_tps(
                args.model, batch, args.input_len, args.output_len, threads=args.threads
            )
        }
        rows[f"engine b={batch}"] = {
            "output_throughput": engine_tps(
                args.model, batch, args.input_len, args.output_len, threads=args.threads
            )
        }
    print(f"\n### mono vs transformers ({date.today()}, {machine()})\n")
    print(
        f"input {args.input_len} tokens, output {args.output_len} tokens, model {args.model.name}, "
        f"{args.threads} torch thread(s) each\n"
    )
    print("| run | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | ratio vs transformers |")
    print("|---|---|---|---|---|")
    for conc in (1, 16):
        r = rows[f"tandem c={conc}"]
        hf = rows[f"transformers b={conc}"]["output_throughput"]
        print(
            f"| tandem concurrency {conc} | {r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p99']:.1f} "
            f"| {r['itl_ms']['p50']:.2f} / {r['itl_ms']['p99']:.2f} | {r['output_throughput']:.1f} "
            f"| {r['output_throughput'] / hf:.2f}x |"
        )
        eng = rows[f"engine b={conc}"]["output_throughput"]
        print(
            f"| tandem engine in-process, batch {conc} (no gRPC/HTTP) | | | {eng:.1f} | "
            f"{eng / hf:.2f}x |"
        )
        print(f"| transformers generate batch {conc} | | | {hf:.1f} | 1.00x |")
    return rows


def pd_vs_mono(args: argparse.Namespace) -> dict[str, Any]:
    spec = BenchSpec(
        input_len=32,
        output_len=64,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        long_every=args.long_every,
        long_input_len=args.long_input_len,
        seed=2,
    )
    rows: dict[str, Any] = {}
    for name, config in (("mono", "configs/tiny-mono.yaml"), ("1P1D", "configs/tiny-1p1d.yaml")):
        with (
            tempfile.TemporaryDirectory() as tmp,
            running_cluster(config, tmp=Path(tmp), model=args.model) as c,
        ):
            bench(
                c.url, BenchSpec(input_len=16, output_len=4, num_requests=4, concurrency=4)
            )  # warm-up
            rows[name] = bench(c.url, spec)
    print(f"\n### mixed load: 1P1D vs mono ({date.today()}, {machine()})\n")
    print(
        f"{spec.num_requests} requests at concurrency {spec.concurrency}; short: {spec.input_len} "
        f"in / {spec.output_len} out; every {spec.long_every}th request has a "
        f"{spec.long_input_len}-token prompt\n"
    )
    print(
        "| cluster | short TTFT p50 / p99 ms | short ITL p50 / p99 ms | long TTFT p50 / p99 ms | "
        "output tok/s |"
    )
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        s, lg = r["groups"]["short"], r["groups"]["long"]
        print(
            f"| {name} | {s['ttft_ms']['p50']:.1f} / {s['ttft_ms']['p99']:.1f} | "
            f"{s['itl_ms']['p50']:.2f} / {s['itl_ms']['p99']:.2f} | {lg['ttft_ms']['p50']:.1f} / "
            f"{lg['ttft_ms']['p99']:.1f} | {r['output_throughput']:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("which", choices=["mono-vs-hf", "pd-vs-mono"])
    parser.add_argument("--model", type=Path, default=EMBEDDED_MODEL)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--long-input-len", type=int, default=448)  # + 64 out fits the embedded 512
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads: the mono worker and transformers alike",
    )
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()
    rows = mono_vs_hf(args) if args.which == "mono-vs-hf" else pd_vs_mono(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
