"""The paged decode kernel's launch settings at long context (issue 20), swept on one GPU.

Every (BLOCK_N, num_stages, num_warps, splits) over bf16 and e4m3 pages, at 32k context (or
`--ctx`) with batch 1 (splits 16-128) and batch 8 (splits 4-16); 32 q / 8 kv heads of 128,
pages of 16 tokens shuffled, int64 page table and lengths as the engine's graphs hold them.
Triton compiles each setting in a pool of processes first (the shared cache), then one process
times them all: KV GB/s (read once a call, the merge of the splits included) over 16-64 calls
captured in one CUDA graph (at batch 1 rotating over four copies of the pages, so L2 holds
none), best of `--rounds` interleaved rounds, beside the setting the engine picks today
(`decode_launch`). `--check`: the engine's settings against the ones before token-major V
(e4m3 pages' V feature-major, split by BEFORE_SPLITS' rule) over long and short contexts and
batches, in one process, graph-timed the same way. `--set KEY=VALUE` (repeatable) overrides
the kernel's settings: in a sweep, every setting tried; with `--check`, the engine's settings
against the same with the overrides, with the largest difference between their outputs
relative to the largest output. e4m3 pages are built as a KVCache keeps them (V token-major).
Writes decode_kernel.json to $OUT (or the current directory).

    python3 -m bench.decode_kernel [--rounds 2] [--top 8] [--check] [--set BLOCK_N=64]
    python3 -m bench.decode_kernel --pages fp8 --warps 2,4 --splits 8=16,32  # a narrower sweep
    python3 -m bench.decode_kernel --ctx 576 --splits 64=1,2,4  # batch 64 at a short context
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gemv import graph_time  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
CTX = 32768
# The sweep's defaults: batch: split counts tried; BLOCK_N, stages and warps
SPLITS = {1: (16, 32, 64, 128), 8: (4, 8, 16)}
TILES = ((32, 64, 128), (2, 3, 4), (4, 8))
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# --check: (context, batch) pairs, and what it compares the engine's settings with: e4m3 pages
# read feature-major V (the layout before token-major V), split by the rule of then (programs
# aimed at, most splits).
CHECK = ((32768, 1), (32768, 8), (4096, 8), (2048, 16), (1024, 1), (576, 64))
BEFORE_SPLITS = (1056, 32)


def _tensors(dtype: torch.dtype, batch: int, pages: int) -> dict[str, Any]:
    """Pages as a KVCache keeps them: e4m3 V token-major ([P, Hkv, D, S] viewed as [P, Hkv, S,
    D]); `v_feature_major` holds the same values feature-major (the layout before)."""
    kc = torch.randn(pages, HKV, PAGE, D, device="cuda").to(dtype)
    vc = torch.randn(pages, HKV, PAGE, D, device="cuda").to(dtype)
    scales, feature_major = None, vc
    if dtype == torch.float8_e4m3fn:
        scales = (torch.rand(HKV, device="cuda") + 0.5, torch.rand(HKV, device="cuda") + 0.5)
        vc = vc.transpose(2, 3).contiguous().transpose(2, 3)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return dict(q=q, k_cache=kc, v_cache=vc, kv_scales=scales, v_feature_major=feature_major)


def _setting(name: str, bn: int, stages: int, warps: int,
             overrides: tuple[tuple[str, int], ...] = ()) -> dict[str, Any]:
    from worker.model.triton_decode import DECODE_CONFIGS

    fp8 = name == "fp8"
    return DECODE_CONFIGS[fp8] | dict(BLOCK_N=bn, num_stages=stages, num_warps=warps) | dict(
        overrides)


def _compile(job: tuple[str, int, int, int, int, tuple[tuple[str, int], ...]]) -> str | None:
    """One setting compiled (a call on a short context with the long one's specializations)."""
    from worker.model.triton_decode import triton_paged_decode

    name, bn, stages, warps, splits, overrides = job
    t = _tensors(DTYPES[name], 1, 64)
    table = torch.randint(0, 64, (1, CTX // PAGE), device="cuda")  # int64, as the engine's
    lens = torch.full((1,), 256, device="cuda")
    try:
        triton_paged_decode(t["q"], t["k_cache"], t["v_cache"], table, lens, D**-0.5,
                            num_splits=splits, kv_scales=t["kv_scales"],
                            **_setting(name, bn, stages, warps, overrides))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # shared memory or registers past the SM's: not a setting
        return f"{type(e).__name__}: {str(e)[:120]}"


class Shape:
    """One (page dtype, context, batch): pages shuffled over enough copies that the calls of a
    graph (rotating over them) find none in L2, and the KV GB/s of a setting."""

    def __init__(self, name: str, ctx: int, batch: int) -> None:
        dtype = DTYPES[name]
        need = batch * ctx // PAGE
        self.gb = 2 * need * HKV * PAGE * D * dtype.itemsize / 1e9
        self.sets = max(1, min(64, -(-256 // int(self.gb * 1000 + 1))))  # >= 256 MB in all
        self.bufs = _tensors(dtype, batch, need * self.sets)
        # [sets, B, 2048]: the width (the row stride) of the engine's table at 32k
        self.tables = torch.zeros(self.sets, batch, CTX // PAGE, dtype=torch.int64, device="cuda")
        self.tables[..., : ctx // PAGE] = torch.randperm(need * self.sets, device="cuda").view(
            self.sets, batch, -1)
        self.lens = torch.full((batch,), ctx, device="cuda")

    def call(self, cfg: dict[str, Any], splits: int, table: torch.Tensor,
             feature_major: bool = False) -> torch.Tensor:
        from worker.model.triton_decode import triton_paged_decode

        b = self.bufs
        v = b["v_feature_major"] if feature_major else b["v_cache"]
        return triton_paged_decode(b["q"], b["k_cache"], v, table, self.lens,
                                   D**-0.5, num_splits=splits, kv_scales=b["kv_scales"], **cfg)

    def rate(self, cfg: dict[str, Any], splits: int, feature_major: bool = False) -> float:
        def call(table: torch.Tensor) -> torch.Tensor:
            return self.call(cfg, splits, table, feature_major)

        # as the engine's decode steps replay it (timed eagerly, a one-request call measures
        # Python's launch of its two kernels, ~50 us, not the GPU)
        calls = [functools.partial(call, self.tables[i % self.sets])
                 for i in range(max(16, self.sets))]
        return self.gb / (graph_time(lambda: [c() for c in calls], 3, min_s=0.02) / len(calls))


def sweep(rounds: int, top: int, pages: list[str], grid: list[tuple[int, ...]],
          splits: dict[int, tuple[int, ...]], overrides: tuple[tuple[str, int], ...],
          ctx: int = CTX) -> dict[str, Any]:
    from worker.model.triton_decode import decode_launch

    jobs = [(name, bn, st, nw, sp, overrides) for name in pages for bn, st, nw in grid
            for sp in sorted({s for ss in splits.values() for s in ss})]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(14, os.cpu_count() or 1)) as pool:
        failed = {job: err for job, err in zip(jobs, pool.map(_compile, jobs), strict=True) if err}
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} settings in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    out: dict[str, Any] = {"ctx": ctx, "failed": [list(j[:5]) for j in failed]}
    for name in pages:
        fp8 = name == "fp8"
        for batch, split_counts in splits.items():
            shape = Shape(name, ctx, batch)
            engine_splits, cfg = decode_launch(batch, HKV, fp8)
            default = (cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"], engine_splits)
            best: dict[tuple[int, ...], float] = {}
            for _ in range(rounds):
                for (bn, st, nw), sp in itertools.product(grid, split_counts):
                    if (name, bn, st, nw, sp, overrides) not in failed:
                        rate = shape.rate(_setting(name, bn, st, nw, overrides), sp)
                        best[(bn, st, nw, sp)] = max(best.get((bn, st, nw, sp), 0.0), rate)
            ranked = sorted(best.items(), key=lambda kv: -kv[1])
            row = {"default": [list(default), round(best.get(default, 0.0))],
                   "best": [[list(k), round(v)] for k, v in ranked[:top]]}
            out[f"{name}_b{batch}"] = row
            print(f"{name} {ctx} x {batch}: default {default} {row['default'][1]} GB/s; best "
                  + "; ".join(f"{k} {v}" for k, v in row["best"]), flush=True)
            del shape
            torch.cuda.empty_cache()
    return out


def check(rounds: int, pages: list[str], overrides: tuple[tuple[str, int], ...]
          ) -> dict[str, Any]:
    """The engine's settings now against the ones before (e4m3 V feature-major, split by
    BEFORE_SPLITS' rule) or, given overrides, against themselves with the overrides, per
    (page dtype, context, batch)."""
    from worker.model.triton_decode import decode_launch, num_decode_splits

    out: dict[str, Any] = {}
    for name in pages:
        fp8 = name == "fp8"
        for ctx, batch in CHECK:
            shape = Shape(name, ctx, batch)
            engine_splits, engine_cfg = decode_launch(batch, HKV, fp8)
            now = (engine_cfg, engine_splits, False)
            before_splits, before_cfg = decode_launch(batch, HKV, fp8)
            if fp8 and before_splits > 1:
                before_splits = num_decode_splits(batch, HKV, *BEFORE_SPLITS)
            before = (before_cfg, before_splits, fp8)
            if overrides:  # "before" is the engine's now; "now" the same with the overrides
                before, now = now, (now[0] | dict(overrides), now[1], False)
            best = [0.0, 0.0]
            for _ in range(rounds):
                for i, (cfg, splits, feature_major) in enumerate((before, now)):
                    best[i] = max(best[i], shape.rate(cfg, splits, feature_major))
            a, b = (shape.call(cfg, splits, shape.tables[0], fm).float()
                    for cfg, splits, fm in (before, now))
            row = {"before_GBps": round(best[0]), "now_GBps": round(best[1]),
                   "ratio": round(best[1] / best[0], 3), "splits": [before[1], now[1]],
                   "max_diff": float((a - b).abs().max() / a.abs().max())}
            out[f"{name}_{ctx}_b{batch}"] = row
            print(f"check {name} {ctx} x {batch}: {row}", flush=True)
            del shape
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--check", action="store_true",
                    help="the engine's settings against the ones before (check())")
    ap.add_argument("--pages", default="bf16,fp8", help="page dtypes swept or checked")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kernel setting overridden (repeatable; see the module docstring)")
    for flag, values in zip(("--blocks", "--stages", "--warps"), TILES, strict=True):
        ap.add_argument(flag, default=",".join(map(str, values)), help="values swept")
    ap.add_argument("--ctx", type=int, default=CTX, help="context of the sweep (at most 32k)")
    ap.add_argument("--splits", action="append", metavar="B=S,S",
                    help="a batch and its split counts (repeatable; default "
                         + " ".join(f"{b}={','.join(map(str, ss))}" for b, ss in SPLITS.items())
                         + ")")
    args = ap.parse_args()

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(v) for v in text.split(","))

    grid = list(itertools.product(ints(args.blocks), ints(args.stages), ints(args.warps)))
    splits = ({int(b): ints(ss) for b, ss in (item.split("=") for item in args.splits)}
              if args.splits else SPLITS)
    out = {"device": torch.cuda.get_device_name()}
    overrides = tuple((k, int(v)) for k, v in (item.split("=") for item in args.set))
    pages = args.pages.split(",")
    out |= (check(args.rounds + 1, pages, overrides) if args.check
            else sweep(args.rounds, args.top, pages, grid, splits, overrides, args.ctx))
    name = "decode_kernel_check.json" if args.check else "decode_kernel.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
