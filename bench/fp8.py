"""FP8 on one GPU (issue 20), every compared figure from ONE process.

Sections (`--sections`, default all):
- ceilings: device-to-device copy GB/s, bf16 and FP8 (torch._scaled_mm, per-tensor) 8192³
  matmul TFLOP/s — the rates the figures below are divided by.
- gemm: the block-scaled GEMM (worker/model/fp8_gemm.py, Triton) on the 8B projection shapes at
  M = 16, 64 and 8192 (its best tile of GEMM_CONFIGS beside its default), next to
  torch._scaled_mm with the same 1x128 / 128x128 scales (cuBLAS, CUDA ≥ 12.9) and bf16 cuBLAS.
- decode: the Engine (qwen3-8b shape, dummy weights) with FP8 weights at batch 1 vs its FP8
  roofline ((FP8 weight bytes + KV bytes) per step ÷ copy rate), and batches 16 and 64 with FP8
  weights and FP8 KV, with a torch.profiler look at batches 1 and 64; batch 16 again with the
  split-K GEMM off (`without_splitk`, the baseline of the same process), batch 64 again with
  its decode attention split as before (`with_split_fp8_batches`), and with that and its GEMMs
  through cuBLAS instead of the split-K GEMM (`without_quantized_splitk`); the bf16 engine at
  batch 1 beside it.
- prefill: one 8192-token prompt through the FP8 engine; TFLOP/s vs the FP8 matmul rate; again
  with each GEMM quantizing its own input (`without_fused_quant`).
- room: KV bytes per token a 1P1D room ships, bf16 vs FP8 pages (the pool's page bytes; the
  transfer GB/s: bench/gpu_pd.py with `--set cache.kv_cache_dtype=fp8_e4m3`).
- longctx: decode batch 1 and 8 at 16k and 32k context, bf16 and FP8 KV (bf16 weights), vs
  roofline; a torch.profiler look at batch 1's steps at 32k (kernel time per step, top kernels).
- longctx_ab (not in the default): batch 1 and 8 at 32k over FP8 KV, the engine as it is
  against itself before the decode kernel's register cap over e4m3 pages and the few-token
  q/k/v tiles (`without_decode_maxnreg`, `without_few_token_tiles`); each engine built inside
  its patches, one at a time, in turns.

    python3 bench/fp8.py [--quick] [--sections ceilings,decode]

The baselines' patches (`without_*`, `with_*`) are in bench/fp8_variants.py.

Writes fp8.json to $OUT (or the current directory) and prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fp8_variants import (  # noqa: E402
    with_split_fp8_batches,
    without_decode_maxnreg,
    without_few_token_tiles,
    without_fused_quant,
    without_quantized_splitk,
    without_splitk,
)
from bench.gpu import (  # noqa: E402
    MODEL_DIR,
    ceilings,
    cuda_time,
    model_sizes,
    profile_decode,
    random_prompts,
    run_requests,
)
from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine  # noqa: E402

SECTIONS = ("ceilings", "gemm", "decode", "prefill", "room", "longctx")
OPTIONAL = ("longctx_ab",)
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 512, 128, 8192


def fp8_model_dir() -> Path:
    """The 8B-shape config with a block-scaled FP8 quantization_config (dummy weights)."""
    out = Path(tempfile.mkdtemp(prefix="qwen3-8b-fp8-"))
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    for f in MODEL_DIR.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    return out


def engine(path: Path, kv: str, max_len: int, seqs: int, tokens: int) -> Engine:
    e = Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), load_format="dummy", max_model_len=max_len),
            cache=CacheConfig(page_size=16, max_total_tokens=tokens, kv_cache_dtype=kv),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(max_num_seqs=seqs, chunked_prefill_size=PREFILL_LEN),
            parallel=ParallelConfig(device="cuda"),
        )
    )
    e.warm_up()
    return e


def kv_bytes_per_token(e: Engine) -> int:
    s = e.kv.shape
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize


def decode(
    e: Engine, batch: int, prompt_len: int, new: int, bw: float, seed: int
) -> dict[str, float]:
    prompts = random_prompts(batch, prompt_len, e.spec.vocab_size, seed)
    _, t = run_requests(e, prompts, new)
    tok_s = batch * (new - 1) / t
    weights = model_sizes(e)["weight_bytes_per_step"]
    roof = batch / ((weights + batch * (prompt_len + new / 2) * kv_bytes_per_token(e)) / bw)
    return {
        "tok_s": tok_s,
        "roofline_tok_s": roof,
        "pct": 100 * tok_s / roof,
        "weight_GB": weights / 1e9,
    }


def longctx_ab(bw: float, new: int) -> dict[str, Any]:
    """The longctx_ab section (module docstring): {variant: {case: best tok/s, pct}}. One
    engine at a time (each takes the GPU's memory), built in turns: now, before, now, before."""
    from contextlib import ExitStack

    variants: dict[str, tuple[Callable[[], ContextManager[Any]], ...]] = {
        "now": (), "before": (without_decode_maxnreg, without_few_token_tiles)}
    rows: dict[str, dict[str, float]] = {name: {} for name in variants}
    out: dict[str, Any] = {"fp8_e4m3": rows}
    for r in range(2):
        for name, cms in variants.items():
            with ExitStack() as stack:
                for cm in cms:
                    stack.enter_context(cm())
                e = engine(MODEL_DIR, "fp8_e4m3", 32768 + 256, 8, 8 * (32768 + new))
            for b in (1, 8):
                got = decode(e, b, 32768 - new, min(new, 64), bw, 32768 + b + 10 * r)
                for key, value in ((f"32k_b{b}", got["tok_s"]), (f"32k_b{b}_pct", got["pct"])):
                    rows[name][key] = max(rows[name].get(key, 0.0), value)
            print(f"[longctx_ab round {r} {name}] {json.dumps(rows[name])}", flush=True)
            if r == 1 and name == "now":
                out["profile_32k_b1"] = profile_decode(e, 1, 10, 32768 - 64)
            del e
            torch.cuda.empty_cache()
    return out


def fp8_matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = cuda_time(lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16), 20)
    return 2 * 8192**3 / t / 1e12


GEMM_CONFIGS = {  # the block GEMM's tile shapes tried per token count (fp8_gemm._config's)
    16: [
        dict(BLOCK_M=16, BLOCK_N=bn, GROUP_M=1, num_warps=4, num_stages=ns)
        for bn in (32, 64, 128)
        for ns in (4, 5)
    ],
    64: [
        dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=1, num_warps=4, num_stages=ns)
        for bm in (16, 32, 64)
        for bn in (32, 64, 128)
        for ns in (3, 4, 5)
    ],
    8192: [
        dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=nw, num_stages=ns)
        for bm, bn, nw, ns in (
            (128, 128, 8, 3),
            (128, 128, 4, 3),
            (128, 128, 8, 4),
            (128, 256, 8, 3),
            (128, 256, 8, 4),
            (64, 128, 4, 4),
            (256, 128, 8, 3),
            (64, 256, 4, 3),
        )
    ],
}


def _gemm_row(
    m: int, weights: list[tuple[torch.Tensor, torch.Tensor]], wb: torch.Tensor
) -> dict[str, Any]:
    """One projection at M tokens, replayed as a CUDA graph over `weights` (copies enough that
    nothing is served from L2): the Triton block GEMM with each of GEMM_CONFIGS[m] (its best
    and its default), cuBLAS blockwise scaled_mm with the same 1x128 / 128x128 scales, bf16
    cuBLAS (one copy)."""
    from bench.gemv import graph_time
    from worker.arch.fp8_config import BlockFp8Config
    from worker.model.fp8_act import quantize_activations
    from worker.model.fp8_gemm import block_fp8_matmul

    n, k = weights[0][0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_activations(x)
    flops = 2 * m * n * k
    quant = BlockFp8Config()

    def tflops(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        return flops * len(weights) / graph_time(lambda: [fn(w, s) for w, s in weights]) / 1e12

    def triton(**cfg: int) -> float:
        return tflops(
            lambda w, s: block_fp8_matmul(xq, xs, w, s, quant, None, torch.bfloat16, **cfg)
        )

    tried = []
    for cfg in GEMM_CONFIGS[m]:
        try:
            tried.append((triton(**cfg), cfg))
        except Exception as exc:  # a tile the compiler rejects (shared memory, registers)
            print(f"  gemm {n}x{k} m={m} {cfg}: {type(exc).__name__}", flush=True)
    tried.sort(key=lambda t: -t[0])
    default = triton()
    row: dict[str, Any] = {
        "triton_TFLOPs": default,
        "triton_weight_GBps": default * 1e3 / (2 * m),  # one byte per weight read per call
        "triton_best_TFLOPs": tried[0][0] if tried else None,
        "triton_best": tried[0][1] if tried else None,
        "quant_act_us": cuda_time(lambda: quantize_activations(x), 10) * 1e6,
        "bf16_TFLOPs": flops / cuda_time(lambda: x @ wb.t(), 10) / 1e12,
    }
    try:  # cuBLAS blockwise: A scales 1x128 (M-major), B scales 128x128
        sa = xs.t().contiguous().t()
        row["scaled_mm_TFLOPs"] = tflops(
            lambda w, s: torch._scaled_mm(xq, w.t(), sa, s.t(), out_dtype=torch.bfloat16)
        )
    except Exception as exc:  # not every torch / CUDA build has the blockwise recipe
        row["scaled_mm_error"] = str(exc).splitlines()[0][:160]
    return row


def gemm() -> dict[str, Any]:
    out = {}
    for name, (n, k) in {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    }.items():
        copies = max(1, -(-(256 << 20) // (n * k)))  # ≥ 256 MiB of weights: past L2
        weights = [
            (
                (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn),
                torch.rand(n // 128, k // 128, device="cuda") * 1e-3,
            )
            for _ in range(copies)
        ]
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (16, 64, 8192):
            out[f"{name}_m{m}"] = _gemm_row(m, weights if m <= 64 else weights[:1], wb)
        del weights, wb
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    ap.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}"
    )
    args = ap.parse_args()
    chosen = set(args.sections.split(","))
    if chosen - set(SECTIONS + OPTIONAL):
        ap.error(f"--sections: unknown {sorted(chosen - set(SECTIONS + OPTIONAL))}")
    new = 32 if args.quick else NEW_TOKENS
    out_dir = Path(os.environ.get("OUT", "."))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    errors: dict[str, str] = {}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
            print(
                f"[{name}] {time.perf_counter() - t0:.1f}s "
                f"{json.dumps(res[name], default=str)[:700]}",
                flush=True,
            )
            return res[name]
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{errors[name]}", flush=True)
            return None
        finally:
            (out_dir / "fp8.json").write_text(
                json.dumps({**res, "errors": errors}, indent=1, default=str)
            )

    ceil = section("ceilings", lambda: {**ceilings(), "fp8_matmul_TFLOPs": fp8_matmul_rate()}) or {}
    bw = ceil.get("copy_GBps", 4200.0) * 1e9
    if "gemm" in chosen:
        section("gemm", gemm)
    fp8_dir = fp8_model_dir()
    if chosen & {"decode", "prefill", "room"}:
        e8 = engine(fp8_dir, "fp8_e4m3", 16384, 64, 64 * (PROMPT_LEN + new) + 2 * PREFILL_LEN)
        if "decode" in chosen:
            section("fp8_weights_b1", lambda: decode(e8, 1, PROMPT_LEN, new, bw, 1))
            section("fp8_weights_fp8_kv_b16", lambda: decode(e8, 16, PROMPT_LEN, new, bw, 16))
            section("fp8_weights_fp8_kv_b64", lambda: decode(e8, 64, PROMPT_LEN, new, bw, 64))
            for b in (1, 64):  # where the steps' time goes
                section(f"profile_fp8_b{b}", lambda b=b: profile_decode(e8, b, 10, PROMPT_LEN))

        def prefill(seeds: tuple[int, ...] = (7, 8)) -> dict[str, float]:
            t = min(  # each run its own prompt: none of it in the prefix cache
                run_requests(e8, random_prompts(1, PREFILL_LEN, e8.spec.vocab_size, s), 1)[0]
                for s in seeds
            )
            s = e8.spec
            flops = (
                2 * model_sizes(e8)["layer_matmul_params"] * PREFILL_LEN
                + 4 * (PREFILL_LEN**2 / 2) * s.head_dim * s.num_heads * s.num_layers
            )
            rate = ceil.get("fp8_matmul_TFLOPs", 1600.0)
            return {
                "tok_s": PREFILL_LEN / t,
                "TFLOPs": flops / t / 1e12,
                "pct_of_fp8_matmul": 100 * flops / t / 1e12 / rate,
            }

        if "prefill" in chosen:
            section("prefill_8k_fp8", prefill)
            with without_fused_quant():  # prefill runs eagerly: the dispatch changes in place
                section("unfused_quant_prefill_8k_fp8", lambda: prefill((9, 10)))
        if "room" in chosen:
            page = e8.kv.shape.page_bytes / e8.kv.shape.page_size
            section(
                "room_bytes_per_token", lambda: {"fp8_kv": page, "bf16_kv": 2 * page, "ratio": 0.5}
            )
        del e8
        torch.cuda.empty_cache()
    if "decode" in chosen:  # the baseline: the same engine with the dispatch before split-K
        with without_splitk():
            e8 = engine(fp8_dir, "fp8_e4m3", 16384, 64, 64 * (PROMPT_LEN + new))
            section(
                "before_fp8_weights_fp8_kv_b16", lambda: decode(e8, 16, PROMPT_LEN, new, bw, 16)
            )
            del e8
            torch.cuda.empty_cache()
        with with_split_fp8_batches():  # batch 64's attention split in 128-token blocks
            e8 = engine(fp8_dir, "fp8_e4m3", 16384, 64, 64 * (PROMPT_LEN + new))
            section("split_attn_fp8_weights_fp8_kv_b64",
                    lambda: decode(e8, 64, PROMPT_LEN, new, bw, 64))
            del e8
            torch.cuda.empty_cache()
            with without_quantized_splitk():  # and its GEMMs through cuBLAS
                e8 = engine(fp8_dir, "fp8_e4m3", 16384, 64, 64 * (PROMPT_LEN + new))
                section("cublas_fp8_weights_fp8_kv_b64",
                        lambda: decode(e8, 64, PROMPT_LEN, new, bw, 64))
                del e8
                torch.cuda.empty_cache()
        eb = engine(MODEL_DIR, "auto", 16384, 8, 8 * (PROMPT_LEN + new))
        section("bf16_b1", lambda: decode(eb, 1, PROMPT_LEN, new, bw, 2))
        del eb
        torch.cuda.empty_cache()
    if "longctx" in chosen:
        for kv in ("auto", "fp8_e4m3"):
            el = engine(MODEL_DIR, kv, 32768 + 256, 8, 8 * (32768 + new) + PREFILL_LEN)
            for ctx in (16384, 32768):
                for b in (1, 8):
                    section(
                        f"longctx_{kv}_{ctx // 1024}k_b{b}",
                        lambda el=el, ctx=ctx, b=b: decode(
                            el, b, ctx - new, min(new, 64), bw, ctx + b
                        ),
                    )
            section(f"profile_longctx_{kv}_32k_b1",
                    lambda el=el: profile_decode(el, 1, 10, 32768 - 64))
            del el
            torch.cuda.empty_cache()
    if "longctx_ab" in chosen:
        section("longctx_ab", lambda: longctx_ab(bw, new))
    print("\n== summary (one process) ==")
    if ceil:
        print(
            f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul "
            f"{ceil['matmul_TFLOPs']:.0f}, "
            f"FP8 matmul {ceil['fp8_matmul_TFLOPs']:.0f} TFLOP/s"
        )
    for key, value in res.items():
        if isinstance(value, dict) and "tok_s" in value:
            pct = (
                f" ({value['pct']:.1f}% of {value['roofline_tok_s']:.0f})" if "pct" in value else ""
            )
            print(f"{key:<28}{value['tok_s']:>10.1f} tok/s{pct}")
    if errors:
        print("errors in:", ", ".join(errors))


if __name__ == "__main__":
    main()
