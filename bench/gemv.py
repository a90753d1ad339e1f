"""Single-token projections on one GPU: our Triton GEMV (worker/model/gemv.py) vs cuBLAS.

For each projection of the qwen3-8b shape (qkv, o, gate|up with SiLU·mul, down, lm_head) on
one row: one CUDA graph calls the projection once per layer's own weight matrix (36 of them,
so nothing is served from L2, as in a real step), replayed; GB/s = weight bytes ÷ time. The
copy ceiling of the same process is printed first. `--sweep` first tries block shapes and
launch settings on each projection and prints the best few.

    python3 bench/gemv.py [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.model.gemv import gemv  # noqa: E402

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 4096, 12288, 4096, 1024, 151936, 36
SHAPES = {  # name: (rows of W, K, pair, copies)
    "qkv": (Q + 2 * KV, HIDDEN, False, LAYERS),
    "o": (HIDDEN, Q, False, LAYERS),
    "gate_up": (2 * INTER, HIDDEN, True, LAYERS),
    "down": (HIDDEN, INTER, False, LAYERS),
    "lm_head": (VOCAB, HIDDEN, False, 2),
}


def graph_time(fn: Callable[[], object], replays: int = 10) -> float:
    """Seconds per call of fn (which launches many kernels) replayed as one CUDA graph."""
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
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / replays


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


def cublas(x: torch.Tensor, w: torch.Tensor, pair: bool) -> torch.Tensor:
    y = F.linear(x, w)
    if pair:
        g, u = y.chunk(2, -1)
        return F.silu(g) * u
    return y


def rate(name: str, impl: Callable[[torch.Tensor, torch.Tensor, bool], object],
         weights: dict[str, list[torch.Tensor]]) -> float:
    """GB/s of weights read by `impl` over every copy of projection `name`, one row of x."""
    n, k, pair, _ = SHAPES[name]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ws = weights[name]
    t = graph_time(lambda: [impl(x, w, pair) for w in ws])
    return len(ws) * n * k * 2 / t / 1e9


def sweep(weights: dict[str, list[torch.Tensor]]) -> dict[str, list[tuple[float, dict]]]:
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            for bn, bk, nw, ns in itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8), (1, 2))]
    best: dict[str, list[tuple[float, dict]]] = {}
    for name in SHAPES:
        scores = []
        pair = SHAPES[name][2]
        for cfg in grid:
            if cfg["BLOCK_N"] * cfg["BLOCK_K"] * (2 if pair else 1) > 64 * 32 * cfg["num_warps"]:
                continue  # the float32 partial sums would not fit in 64 registers per thread
            try:
                gbs = rate(name, lambda x, w, pair, cfg=cfg: gemv(x, w, pair=pair, **cfg), weights)
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                continue
            scores.append((gbs, cfg))
        scores.sort(key=lambda s: -s[0])
        best[name] = scores[:5]
        print(f"{name}: cublas {rate(name, cublas, weights):.0f} GB/s; best "
              + "; ".join(f"{g:.0f} {c}" for g, c in scores[:5]), flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_ceiling()}
    print(f"copy ceiling {result['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    weights = {name: [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                      for _ in range(copies)] for name, (n, k, _, copies) in SHAPES.items()}
    if args.sweep:
        result["sweep"] = sweep(weights)
    rows = {}
    for name in SHAPES:
        cfg = result["sweep"][name][0][1] if args.sweep else {}  # type: ignore[index]
        ours = rate(name, lambda x, w, pair, cfg=cfg: gemv(x, w, pair=pair, **cfg), weights)
        theirs = rate(name, cublas, weights)
        rows[name] = {"gemv_GBps": ours, "cublas_GBps": theirs}
        print(f"{name:8s}: gemv {ours:6.0f} GB/s  cublas {theirs:6.0f} GB/s  ({ours / theirs:.2f}x)", flush=True)
    result["rows"] = rows
    Path(args.out, "gemv.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
