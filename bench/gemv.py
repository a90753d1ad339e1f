"""Single-token projections on one GPU: our Triton GEMV (worker/model/gemv.py) vs cuBLAS.

Each projection of the qwen3-8b shape runs on one row as the engine runs it
(llama.py `DecoderLayer.forward_stream`): qkv with the input norm folded in, o adding into the
residual stream, gate|up with the post-attention norm and SiLU·mul, down adding into the
stream, lm_head into float32 logits. One CUDA graph calls the projection once per layer's own
weight matrix (36 of them, so nothing is served from L2, as in a real step), replayed; GB/s =
weight bytes ÷ time. cuBLAS = F.linear alone (without the glue the GEMV also does). The copy
ceiling of the same process is printed first. `--sweep` first tries block shapes and launch
settings on each projection (compiled in a pool of processes first) and prints the best few.
`--fp8`: block-scaled e4m3 weights (random bytes, 128×128 scales) through the GEMV's FP8 path,
GB/s of weight bytes read (one per weight), with cuBLAS bf16 beside it for reference. Last, the
chain: a step's four GEMVs in layer order over the 36 layers in one graph, as the engine runs
them, with the GEMV's own settings and (after `--sweep`) with each projection's best.

    python3 bench/gemv.py [--fp8] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.model.gemv import gemv  # noqa: E402

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 4096, 12288, 4096, 1024, 151936, 36
SHAPES = {  # name: (rows of W, K, how the engine calls it, copies)
    "qkv": (Q + 2 * KV, HIDDEN, "norm", LAYERS),
    "o": (HIDDEN, Q, "residual", LAYERS),
    "gate_up": (2 * INTER, HIDDEN, "pair", LAYERS),
    "down": (HIDDEN, INTER, "residual", LAYERS),
    "lm_head": (VOCAB, HIDDEN, "logits", 2),
}


def graph_time(fn: Callable[[], object], replays: int = 10, min_s: float = 0.0) -> float:
    """Seconds per call of fn (which launches many kernels) replayed as one CUDA graph:
    `replays` times, or as many more as make `min_s` seconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    while True:
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000
        if seconds >= min_s:
            return seconds / replays
        replays = int(replays * min_s / seconds) + 1


def copy_ceiling() -> float:
    """Device-to-device copy GB/s (read + written), as bench/gpu.py measures it."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1000) / 1e9


Weight = tuple[torch.Tensor, dict[str, Any]]  # (w, the GEMV's FP8 arguments or nothing)


def make_weight(n: int, k: int, fp8: bool) -> Weight:
    if not fp8:
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02, {}
    w = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3
    return w, {"w_scale": scales, "block": (128, 128)}


def ours(
    x: torch.Tensor, w: torch.Tensor, use: str, stream: torch.Tensor, norm: torch.Tensor, **cfg: Any
) -> torch.Tensor:
    if use == "norm":
        return gemv(x, w, norm=(norm, 1e-6), **cfg)
    if use == "pair":
        return gemv(x, w, pair=True, norm=(norm, 1e-6), **cfg)
    if use == "residual":
        return gemv(x, w, residual=stream, **cfg)
    return gemv(x, w, out=torch.empty(1, w.shape[0], dtype=torch.float32, device=x.device), **cfg)


def rate(
    name: str,
    weights: dict[str, list[Weight]],
    cfg: dict[str, int] | None = None,
    cublas: bool = False,
) -> float:
    """GB/s of weights read over every copy of projection `name`, one row of x: our GEMV with
    `cfg` (None: its own choice), or cuBLAS's F.linear alone."""
    n, k, use, _ = SHAPES[name]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    stream = torch.randn(1, n, dtype=torch.bfloat16, device="cuda")
    norm = torch.rand(k, dtype=torch.bfloat16, device="cuda") + 0.5
    ws = weights[name]
    if cublas:  # bf16 weights of the same shape (FP8 ones are not F.linear's)
        dense = [
            w if w.dtype == torch.bfloat16 else torch.empty_like(w, dtype=torch.bfloat16)
            for w, _ in ws
        ]
        t = graph_time(lambda: [F.linear(x, w) for w in dense])
        return len(ws) * n * k * 2 / t / 1e9
    t = graph_time(lambda: [ours(x, w, use, stream, norm, **fp8, **(cfg or {})) for w, fp8 in ws])
    return len(ws) * n * k * ws[0][0].element_size() / t / 1e9


def grid(name: str, fp8: bool) -> list[dict[str, int]]:
    """The settings a sweep tries on projection `name`: K whole in one block (one stage), or
    K blocks pipelined over 2-4 stages, with at most 64 float32 partial sums per thread."""
    _, k, use, _ = SHAPES[name]
    pair = 2 if use == "pair" else 1
    cfgs = []
    whole = 1 << (k - 1).bit_length()
    for bn, nw in itertools.product((2, 4, 8, 16), (4, 8)):
        if bn * whole * pair <= 128 * 32 * nw:  # weights of one block, as bytes per thread
            cfgs.append(dict(BLOCK_N=bn, BLOCK_K=whole, num_warps=nw, num_stages=1))
    widths = (512, 1024, 2048) if fp8 else (1024, 2048)
    for bn, bk, nw, ns in itertools.product((4, 8, 16), widths, (4, 8), (2, 3, 4)):
        if bk < k and bn * bk * pair <= 64 * 32 * nw:
            cfgs.append(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns))
    return cfgs


def _compile(job: tuple[str, bool, tuple[tuple[str, int], ...]]) -> str | None:
    """One setting compiled in a pool process (one copy of the weight: the same
    specializations as the timed calls), so the timing process finds it in Triton's cache."""
    name, fp8, items = job
    n, k, use, _ = SHAPES[name]
    torch.manual_seed(0)
    w, extra = make_weight(n, k, fp8)
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    stream = torch.randn(1, n // 2 if use == "pair" else n, dtype=torch.bfloat16, device="cuda")
    norm = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    try:
        ours(x, w, use, stream, norm, **extra, **dict(items))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # registers or shared memory past the SM's: not a setting
        return f"{type(e).__name__}: {str(e)[:120]}"


def sweep(weights: dict[str, list[Weight]], fp8: bool) -> dict[str, list[tuple[float, dict]]]:
    names = [name for name in SHAPES if not (fp8 and name == "lm_head")]  # lm_head stays bf16
    jobs = [(name, fp8, tuple(cfg.items())) for name in names for cfg in grid(name, fp8)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(14, os.cpu_count() or 1)) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs), strict=True))
    print(f"compiled {sum(e is None for e in errors.values())} of {len(jobs)} settings in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    best: dict[str, list[tuple[float, dict]]] = {}
    for name in names:
        scores = []
        for cfg in grid(name, fp8):
            if errors[(name, fp8, tuple(cfg.items()))] is None:
                scores.append((rate(name, weights, cfg), cfg))
        scores.sort(key=lambda s: -s[0])
        best[name] = scores[:5]
        print(f"{name}: best " + "; ".join(f"{g:.0f} {c}" for g, c in scores[:5]), flush=True)
    return best


def chain(weights: dict[str, list[Weight]], cfgs: dict[str, dict[str, int]]) -> float:
    """GB/s of a step's GEMVs: qkv, o, gate|up, down of each layer in turn, one graph."""
    names = ("qkv", "o", "gate_up", "down")
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    act = torch.randn(1, INTER, dtype=torch.bfloat16, device="cuda")
    stream = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    norm = torch.rand(HIDDEN, dtype=torch.bfloat16, device="cuda") + 0.5

    def step() -> None:
        for layer in range(LAYERS):
            for name in names:
                w, fp8 = weights[name][layer]
                use = SHAPES[name][2]
                ours(act if name == "down" else x, w, use, stream, norm, **fp8,
                     **cfgs.get(name, {}))

    t = min(graph_time(step, 5, 0.05) for _ in range(3))
    return sum(weights[n][i][0].nbytes for n in names for i in range(LAYERS)) / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="block-scaled e4m3 weights")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "copy_GBps": copy_ceiling(),
        "weights": "fp8" if args.fp8 else "bf16",
    }
    print(f"copy ceiling {result['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    weights = {
        name: [make_weight(n, k, args.fp8) for _ in range(copies)]
        for name, (n, k, _, copies) in SHAPES.items()
    }
    best = {}
    if args.sweep:
        swept = sweep(weights, args.fp8)
        result["sweep"] = swept
        best = {name: scores[0][1] for name, scores in swept.items() if scores}
    rows = {}
    for name in SHAPES:
        ours_gbs, theirs = rate(name, weights), rate(name, weights, cublas=True)
        rows[name] = {"gemv_GBps": ours_gbs, "cublas_GBps": theirs}
        print(
            f"{name:8s}: gemv {ours_gbs:6.0f} GB/s  cublas {theirs:6.0f} GB/s  "
            f"({ours_gbs / theirs:.2f}x)",
            flush=True,
        )
    result["rows"] = rows
    result["chain_GBps"] = chain(weights, {})
    print(f"chain   : gemv {result['chain_GBps']:6.0f} GB/s (its own settings)", flush=True)
    if best:
        result["chain_best_GBps"] = chain(weights, best)
        print(f"chain   : gemv {result['chain_best_GBps']:6.0f} GB/s (the sweep's best each: "
              f"{best})", flush=True)
    Path(args.out, "gemv-fp8.json" if args.fp8 else "gemv.json").write_text(
        json.dumps(result, indent=1, default=str)
    )


if __name__ == "__main__":
    main()
