"""1P1D (KV through CUDA IPC) vs a monolithic worker, under the same mixed load.

    python3 -m bench.gpu_pd                          # GPU 0: 8B-shape Qwen3 (dummy, bf16), cuda_ipc
    python3 -m bench.gpu_pd --placement two-gpus     # prefill GPU 0 -> decode GPU 1 vs DP=2 mono
    python3 -m bench.gpu_pd --smoke                  # CPU: the embedded tiny model, mooncake

Placement (`--placement`): `one-gpu` puts every worker on GPU 0 (1P1D's prefill and decode
share it; mono is one worker). `two-gpus` puts 1P1D's prefill on GPU 0 and its decode on GPU 1
(cuda_ipc writes over NVLink into the peer GPU's pool) against a mono worker with attention
DP=2 (`parallel.dp_size: 2`: one replica per GPU behind one scheduler front), so both clusters
hold the same two GPUs.

One call measures, in order:
1. the copy ceiling: device-to-device (GPU) or memcpy (CPU) GB/s, in this process (two-gpus:
   also the GPU 0 -> GPU 1 peer copy);
2. the transfer backend alone between two processes: a decode-sized pool in a spawned
   process (on decode's GPU), this process writing one prompt's KV pages into it (one range,
   then one range per page in shuffled order, as a room with scattered decode pages does;
   bench/page_gather.py has the full comparison of copy paths);
3. two real clusters started at once on the same device (`tandem serve` via running_cluster):
   mono (`role: both`) and 1P1D (prefill + decode, `transfer.backend` cuda_ipc / mooncake),
   each worker with a bounded KV size so all three fit; then the same mixed load on each, one
   after the other (long prompts arrive while short requests stream): TTFT and ITL p50/p99,
   and the KV the workers moved (GetLoad transfer counters; the gateway's per-room time).

Writes gpu_pd.json (every figure, written again after each step, so a cut-short run leaves
what it measured) and gpu_pd.md (a short table) to $OUT, or --out, or the current directory.

The 8B-shape model has no tokenizer: a word-level one covering its whole vocabulary ("w0" ..
"w151935") is written next to its config, and prompts are token ids, so every sampled id
detokenizes to text and prompt lengths are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import torch

from bench.pd_clusters import (
    clusters_at_once,
    placements,
    transfer_figures,
    transfer_snapshot,
    word_level_model,
)
from orchestrator.bench import BenchSpec, run_bench, summarize
from orchestrator.launch.background import EMBEDDED_MODEL, REPO
from transfer.config import TransferConfig
from transfer.contract import KVLayout
from transfer.factory import make_backend

SHAPE_8B = REPO / "bench" / "models" / "qwen3-8b-shape"
# KV pages as the workers lay them out (worker/kv_cache.py); page_size 16.
LAYOUTS = {
    "8b": dict(num_layers=36, num_kv_heads_total=8, head_dim=128, dtype="bfloat16", page_size=16),
    "tiny": dict(num_layers=4, num_kv_heads_total=2, head_dim=32, dtype="float32", page_size=16),
}


def ceiling(device: str) -> float:
    """Bytes read + written per second by one large copy on `device` (best of 5)."""
    src = torch.empty(1 << 30 if device == "cuda" else 256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9


# ---- 2. the backend alone, two processes ---------------------------------------------------------


def peer_ceiling() -> float:
    """Bytes moved per second GPU 0 -> GPU 1 by one torch copy of 1 GiB (best of 5)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")
        best = min(best, time.perf_counter() - t)
    return src.numel() / best / 1e9


def _decode_pool(backend: str, device: str, nbytes: int, cmds: mp.Queue, out: mp.Queue) -> None:
    """Child: a zeroed pool registered with the backend; answers "sum" with a checksum of it."""
    pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    config = TransferConfig(backend=backend)  # type: ignore[arg-type]
    be = make_backend(config, "127.0.0.1", "bench-decode")
    be.register(pool.data_ptr(), nbytes)
    out.put((be.agent_name, be.agent_metadata, pool.data_ptr()))
    try:
        while cmds.get(timeout=300) == "sum":
            out.put(int(pool.sum(dtype=torch.int64)))
    finally:
        be.close()


def backend_rate(
    backend: str, device: str, layout: str, tokens: int, dst_device: str = ""
) -> dict[str, Any]:
    """GB/s of one prompt's KV written into another process's pool (on `dst_device`, default
    `device`): one range, then one per page."""
    lay = KVLayout(num_pages=1, **LAYOUTS[layout])  # type: ignore[arg-type]
    pages = -(-tokens // lay.page_size)
    nbytes = pages * lay.page_bytes
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_decode_pool, args=(backend, dst_device or device, nbytes, cmds, out), daemon=True
    )
    proc.start()
    config = TransferConfig(backend=backend)  # type: ignore[arg-type]
    be = make_backend(config, "127.0.0.1", "bench-prefill")
    try:
        name, meta, dst = out.get(timeout=120)
        be.register(src.data_ptr(), nbytes)
        be.connect(name, meta)
        order = list(range(pages))
        random.Random(0).shuffle(order)
        shapes = {
            "one_range": [(src.data_ptr(), dst, nbytes)],
            "per_page_shuffled": [
                (src.data_ptr() + i * lay.page_bytes, dst + j * lay.page_bytes, lay.page_bytes)
                for i, j in enumerate(order)
            ],
        }
        res: dict[str, Any] = {
            "backend": backend,
            "layout": layout,
            "tokens": tokens,
            "pages": pages,
            "room_bytes": nbytes,
            "into": dst_device or device,
        }
        for shape, spans in shapes.items():
            be.write(name, spans, 60)  # warm-up (first touch, handshake)
            best = min(_timed(functools.partial(be.write, name, spans, 60)) for _ in range(5))
            res[f"{shape}_GBps"] = round(nbytes / best / 1e9, 2)
            res[f"{shape}_ms"] = round(best * 1e3, 3)
        cmds.put("sum")
        res["verified"] = out.get(timeout=60) == nbytes  # every byte landed as 1
        cmds.put("stop")
        return res
    finally:
        be.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ---- 3. clusters (their pieces: bench/pd_clusters.py) -----------------------------------------


def serving(
    args: argparse.Namespace,
    tmp: Path,
    record: Callable[[str, Any], None],
    left: Callable[[], float],
) -> None:
    """Mono and 1P1D up at once; the same mixed load on each; `left()`: seconds of the budget
    left."""
    common = [
        f"cache.max_total_tokens={args.max_total_tokens}",
        f"scheduler.max_num_seqs={args.concurrency * 2}",
        f"scheduler.chunked_prefill_size={args.chunked_prefill_size}",
        "launcher.ready_timeout_s=900",
    ]
    if args.smoke:
        model, device = EMBEDDED_MODEL, "cpu"
        spec_kw: dict[str, Any] = dict(prompt_kind="text")
    else:
        model, device = word_level_model(SHAPE_8B, tmp / "model", args.num_layers), "cuda:0"
        common += [
            "model.load_format=dummy",
            "model.dtype=bfloat16",
            f"model.max_model_len={args.max_model_len}",
        ]
        spec_kw = dict(prompt_kind="ids", vocab_size=151936)
    runs = placements(args, common, device)
    spec = BenchSpec(
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        long_every=args.long_every,
        long_input_len=args.long_input_len,
        seed=3,
        **spec_kw,
    )
    warm = BenchSpec(
        input_len=32,
        output_len=8,
        num_requests=4,
        concurrency=4,
        long_every=2,
        long_input_len=min(args.long_input_len, 256),
        **spec_kw,
    )
    record(
        "load",
        {
            k: getattr(spec, k)
            for k in (
                "input_len",
                "output_len",
                "num_requests",
                "concurrency",
                "long_every",
                "long_input_len",
                "prompt_kind",
            )
        },
    )
    t0 = time.perf_counter()
    try:
        with clusters_at_once(runs, tmp, model, min(args.ready_timeout_s, left() - 30)) as up:
            record("startup_s", round(time.perf_counter() - t0, 1))
            for name in runs:
                asyncio.run(run_bench(up[name].url, warm))
                before = transfer_snapshot(up[name]) if name == "1P1D" else {}
                results, duration = asyncio.run(
                    run_bench(
                        up[name].url, replace(spec, timeout_s=max(1.0, min(spec.timeout_s, left())))
                    )
                )
                record(name, summarize(results, duration, spec))
            record("transfer", transfer_figures(before, transfer_snapshot(up["1P1D"])))
    finally:  # the workers' and gateways' logs go with the figures (their last 20 kB each)
        for log in tmp.glob("*/logs/*/*.log"):  # <run>/logs/<gateway port>/<process>.log
            dst = args.out / "logs" / f"{log.parents[2].name}-{log.name}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(log.read_text(errors="replace")[-20_000:])


# ---- report ------------------------------------------------------------------------------------


def table(r: dict[str, Any]) -> str:
    where = "two GPUs" if r["args"].get("placement") == "two-gpus" else "one device"
    lines = [f"### 1P1D vs mono on {where} ({r['date']}, {r['machine']})", ""]
    if "load" in r:
        ld = r["load"]
        lines += [
            f"{ld['num_requests']} requests at concurrency {ld['concurrency']}; short "
            f"{ld['input_len']} in / {ld['output_len']} out; every {ld['long_every']}th prompt "
            f"{ld['long_input_len']} tokens",
            "",
        ]
    lines += [
        "| cluster | short TTFT p50 / p99 ms | short ITL p50 / p99 ms | long TTFT p50 / p99 ms "
        "| output tok/s | failed |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("mono", "DP=2 mono", "1P1D"):
        if name in r:
            s, lg = r[name]["groups"]["short"], r[name]["groups"]["long"]
            lines.append(
                f"| {name} | {s['ttft_ms']['p50']:.1f} / {s['ttft_ms']['p99']:.1f} | "
                f"{s['itl_ms']['p50']:.2f} / {s['itl_ms']['p99']:.2f} | "
                f"{lg['ttft_ms']['p50']:.1f} / {lg['ttft_ms']['p99']:.1f} | "
                f"{r[name]['output_throughput']:.1f} | {r[name]['failed']} |"
            )
    if "ceiling_GBps" in r:
        lines += [
            "",
            f"copy ceiling: {r['ceiling_GBps']:.0f} GB/s read + written "
            f"({r['ceiling_GBps'] / 2:.0f} GB/s moved)",
        ]
    if "peer_ceiling_GBps" in r:
        lines.append(f"peer copy GPU 0 -> GPU 1: {r['peer_ceiling_GBps']:.0f} GB/s moved")
    if "backend" in r:
        b = r["backend"]
        lines.append(
            f"{b['backend']} between two processes (into {b.get('into', '?')}), "
            f"{b['tokens']}-token prompt ({b['room_bytes'] / 1e6:.1f} MB, "
            f"{b['pages']} pages): one range {b['one_range_GBps']} GB/s, page by page shuffled "
            f"{b['per_page_shuffled_GBps']} GB/s (bytes moved; verified {b['verified']})"
        )
    if "transfer" in r:
        t = r["transfer"]
        lines.append(
            f"1P1D workers moved {t['prefill_sent_bytes'] / 1e9:.2f} GB in {t['rooms']} rooms "
            f"({t['pages']} pages); decode room time (registration to landed, incl. prefill "
            f"compute) {t['room_ms_mean']} ms mean "
            f"-> >= {t['bytes_per_room_time_GBps']} GB/s"
        )
    for e in r.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, embedded tiny model, mooncake")
    ap.add_argument(
        "--placement",
        default="one-gpu",
        choices=("one-gpu", "two-gpus"),
        help="one-gpu: every worker on GPU 0; two-gpus: prefill GPU 0, decode GPU 1 "
        "vs DP=2 mono over both (module doc)",
    )
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument(
        "--backend", default="", help="transfer backend (default cuda_ipc; mooncake with --smoke)"
    )
    ap.add_argument(
        "--num-layers", type=int, default=0, help="8B shape with fewer layers (0 = all 36)"
    )
    ap.add_argument("--num-requests", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=0)
    ap.add_argument("--input-len", type=int, default=0)
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--long-input-len", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=0, help="KV tokens per worker")
    ap.add_argument("--chunked-prefill-size", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--ready-timeout-s", type=float, default=600.0, help="dummy 8B weights start slowly"
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="wall budget of the whole run (0 = none): "
        "readiness and load waits are cut to fit, so the figures are written before a hard kill",
    )
    ap.add_argument(
        "--skip-serving", action="store_true", help="only the ceiling and the backend figures"
    )
    args = ap.parse_args()
    # GPU defaults / smoke defaults for every size left at 0
    gpu = dict(
        backend="cuda_ipc",
        num_requests=64,
        concurrency=16,
        input_len=128,
        output_len=128,
        long_input_len=3072,
        max_total_tokens=49152,
        chunked_prefill_size=2048,
    )
    smoke = dict(
        backend="mooncake",
        num_requests=8,
        concurrency=4,
        input_len=32,
        output_len=16,
        long_input_len=256,
        max_total_tokens=8192,
        chunked_prefill_size=256,
    )
    for k, v in (smoke if args.smoke else gpu).items():
        if not getattr(args, k):
            setattr(args, k, v)

    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # unwind: the clusters are stopped on the way out
    t_end = time.monotonic() + (args.deadline_s or 1e9)

    def left() -> float:
        return t_end - time.monotonic()

    result: dict[str, Any] = {
        "date": str(date.today()),
        "machine": f"{platform.node()}, {os.cpu_count()} cores"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "args": {k: str(v) for k, v in vars(args).items()},
        "errors": [],
    }

    def record(key: str, value: Any) -> None:
        result[key] = value
        (args.out / "gpu_pd.json").write_text(json.dumps(result, indent=1))
        (args.out / "gpu_pd.md").write_text(table(result))
        print(f"[gpu_pd] {key}: {json.dumps(value)[:400]}", flush=True)

    device = "cpu" if args.smoke else "cuda"
    two = args.placement == "two-gpus"
    if two and (args.smoke or torch.cuda.device_count() < 2):
        ap.error("--placement two-gpus needs two visible GPUs (and no --smoke)")
    layout = "tiny" if args.smoke else "8b"
    steps: list[tuple[str, Callable[[], None]]] = [
        ("ceiling", lambda: record("ceiling_GBps", round(ceiling(device), 1))),
        (
            "backend",
            lambda: record(
                "backend",
                backend_rate(
                    args.backend, device, layout, args.long_input_len, "cuda:1" if two else ""
                ),
            ),
        ),
    ]
    if two:
        steps.insert(1, ("peer", lambda: record("peer_ceiling_GBps", round(peer_ceiling(), 1))))
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_serving:
            steps.append(("serving", lambda: serving(args, Path(tmp), record, left)))
        for name, step in steps:
            try:
                step()
            except Exception as e:  # keep the other steps' figures; the error is in the report
                record(
                    "errors", [*result["errors"], f"{name}: {type(e).__name__}: {str(e)[-3000:]}"]
                )
    print(table(result))


if __name__ == "__main__":
    main()
