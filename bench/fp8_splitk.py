"""The split-K FP8 GEMM (worker/model/fp8_splitk.py) against cuBLAS's blockwise _scaled_mm
and, at one token, the FP8 GEMV (worker/model/gemv.py), per 8B projection at 1 to 64 tokens,
one GPU, one process (issue 20).

The split-K GEMM runs as fp8_linear runs it at each token count: x as it is up to 32 tokens,
quantized 1×128 past that. cuBLAS is fed x quantized beforehand, as the kernel before a linear
writes it (fused.py `into=`), so neither row counts the quantizer. Each figure is a CUDA graph
over enough copies of the weight that nothing is served from L2; GB/s = e4m3 weight bytes read
÷ time. `--sweep` first tries tiles, splits and pipeline depths on o, gate|up and down at 16
and 64 tokens. The copy ceiling of the same process is printed first; fp8-splitk.json and a
plot (fp8-splitk.png) land in $OUT.

    python3 bench/fp8_splitk.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import HIDDEN, INTER, KV, Q, copy_ceiling, graph_time  # noqa: E402
from worker.arch.fp8_config import BlockFp8Config  # noqa: E402
from worker.model.fp8_act import PAD_ROWS, Fp8Rows, quantize_activations  # noqa: E402
from worker.model.fp8_splitk import (  # noqa: E402
    Mode,
    SplitCounters,
    default_config,
    fp8_splitk,
    mode,
)
from worker.model.gemv import gemv  # noqa: E402

SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}  # name: (rows of W, K)
TOKENS = (1, 4, 16, 32, 64)
QUANT = BlockFp8Config()


Weights = list[tuple[torch.Tensor, torch.Tensor, SplitCounters]]


def weights(n: int, k: int) -> Weights:
    """Copies of an e4m3 [n, k] with block scales, ≥ 512 MiB in all (past L2), each with its
    own tile counters as each linear has."""
    copies = max(2, -(-(512 << 20) // (n * k)))
    return [
        (
            (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn),
            torch.rand(n // 128, k // 128, device="cuda") * 1e-3,
            SplitCounters(),
        )
        for _ in range(copies)
    ]


def gbps(ws: Weights, fn: Callable[[torch.Tensor, torch.Tensor, SplitCounters], object]) -> float:
    t = graph_time(lambda: [fn(w, s, c) for w, s, c in ws])
    return len(ws) * ws[0][0].numel() / t / 1e9


def row(name: str, ws: Weights, m: int, **cfg: int) -> dict[str, float]:
    """GB/s of one projection at m tokens: the split-K GEMM (with `cfg`) in fp8_linear's mode
    for m, and without cfg also cuBLAS's blockwise _scaled_mm on quantized x and, at one token,
    the FP8 GEMV."""
    n, k = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_activations(x, 128, pad_rows=PAD_ROWS, m_major=True)
    rows = Fp8Rows(xq, xs, m, x.dtype)
    out: dict[str, float] = {}
    if not cfg:
        out["cublas"] = gbps(ws, lambda w, s, c: torch._scaled_mm(
            xq, w.t(), xs, s.t(), out_dtype=torch.bfloat16))
        if m == 1:
            out["gemv"] = gbps(ws, lambda w, s, c: gemv(x, w, w_scale=s, block=(128, 128)))
    x_in = x if mode(m) is Mode.WIDENED else rows
    out["splitk"] = gbps(ws, lambda w, s, c: fp8_splitk(x_in, w, s, QUANT, c, **cfg))
    return out


def sweep(name: str, ws: Weights, m: int) -> list[tuple[float, dict[str, int]]]:
    n, k = SHAPES[name]
    scores = []
    for bn, split, stages, warps in itertools.product(
        (64, 128), (1, 2, 4, 8, 16), (2, 3, 4), (4, 8)
    ):
        if -(-k // 128) < split or (bn == 64 and warps == 8):
            continue
        cfg = dict(BN=bn, SPLIT=split, num_stages=stages, num_warps=warps)
        try:
            scores.append((row(name, ws, m, **cfg)["splitk"], cfg))
        except Exception as exc:  # a tile the compiler rejects (shared memory, registers)
            print(f"  {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
    scores.sort(key=lambda s: -s[0])
    default = default_config(m, n, k, 128)
    best = "; ".join(f"{g:.0f} {c}" for g, c in scores[:4])
    got = row(name, ws, m, **default)["splitk"]
    print(f"{name} m={m}: default {default} {got:.0f}; best {best}", flush=True)
    return scores[:6]


def plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    names = list(rows)
    kinds = sorted({kind for r in rows.values() for kind in r})
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        ax.bar([j + i * width for j in range(len(names))],
               [rows[nm].get(kind, 0) for nm in names], width, label=kind)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30)
    ax.set_ylabel("e4m3 weight GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    out_dir = Path(os.environ.get("OUT", "."))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_ceiling()}
    print(f"copy ceiling {result['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    rows: dict[str, dict[str, float]] = {}
    sweeps: dict[str, Any] = {}
    for name, (n, k) in SHAPES.items():
        ws = weights(n, k)
        if args.sweep and name in ("o", "gate_up", "down"):
            for m in (16, 64):
                sweeps[f"{name}_m{m}"] = sweep(name, ws, m)
        for m in TOKENS:
            rows[f"{name} m={m}"] = row(name, ws, m)
            print(f"{name + ' m=' + str(m):<12}" + "  ".join(
                f"{kind} {v:5.0f}" for kind, v in rows[f"{name} m={m}"].items()), flush=True)
        del ws
        torch.cuda.empty_cache()
    result |= {"rows": rows, "sweeps": sweeps}
    (out_dir / "fp8-splitk.json").write_text(json.dumps(result, indent=1, default=str))
    plot(rows, out_dir / "fp8-splitk.png")


if __name__ == "__main__":
    main()
