"""DeepSeek-V3 decode on one GPU: the engine at batch 1 and 64 next to its roofline, and the
MLA decode kernel alone next to its bandwidth bound, every figure from ONE process.

The model is bench/models/deepseek-v3-shape (V3's shapes, 6 layers: 3 dense + 3 MoE, no MTP)
with dummy weights in bf16 (~76 GB): our Engine with MLA latent pages, the Triton absorbed MLA
decode kernel, fused norms, overlapped decode steps (MoE routing keeps CUDA graphs off).

Roofline of a decode step at batch B: the bytes it must read at the copy bandwidth measured
here, i.e. every weight except the routed experts and the embedding table (gathered, not read),
plus the routed experts that B tokens activate (E * (1 - (1 - k/E)^B) of the E per MoE layer,
uniform routing: dummy weights route about uniformly), plus B contexts of latent pages.

    python3 bench/deepseek.py [--quick] [--layers N] [--sections ceilings,decode,kernel]

Prints a short table last and writes deepseek.json to $OUT (or the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import ceilings, cuda_time, decode_rate  # noqa: E402
from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine  # noqa: E402
from worker.model.deepseek_moe import DeepseekMoE  # noqa: E402

MODEL_DIR = ROOT / "bench" / "models" / "deepseek-v3-shape"
PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS = 512, 64, 64
SECTIONS = ("ceilings", "decode", "kernel")


def model_dir(layers: int, tmp: Path) -> Path:
    """The shape directory, or a copy with `layers` decoder layers (first 3 stay dense)."""
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    if layers == cfg["num_hidden_layers"]:
        return MODEL_DIR
    cfg["num_hidden_layers"] = layers
    cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers - 1)
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def step_bytes(engine: Engine, batch: int, ctx: float) -> dict[str, float]:
    """Bytes one decode step of `batch` requests at context `ctx` must read (see module doc)."""
    model = engine.model
    moes = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
    routed = {id(p) for m in moes for p in (m.w13, m.w2)}
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in routed)
    dense -= embed.numel() * embed.element_size()
    per_expert = sum(m.w13[0].numel() + m.w2[0].numel() for m in moes[:1]) * embed.element_size()
    experts_read = 0.0
    for m in moes:
        e, k = m.num_experts, m.top_k
        experts_read += e * (1 - (1 - k / e) ** batch) * per_expert
    s = engine.kv.shape
    kv = batch * ctx * s.num_layers * s.latent_dim * s.dtype.itemsize
    return {
        "dense_weights": float(dense),
        "routed_experts": experts_read,
        "kv": kv,
        "total": dense + experts_read + kv,
    }


def kernel_bench(bw: float) -> dict[str, Any]:
    """The absorbed MLA decode kernel alone, one V3 layer at TP1 (128 heads, 576-wide latent),
    against the time to read its latent pages once at the copy bandwidth."""
    from worker.model.triton_mla import triton_mla_decode

    out: dict[str, Any] = {}
    page, heads, kv_lora, width = 64, 128, 512, 576
    for b, ctx in ((1, 512), (1, 4096), (64, 512), (64, 4096)):
        pages = -(-ctx // page)
        cache = torch.randn(b * pages + 1, page, width, dtype=torch.bfloat16, device="cuda")
        table = torch.arange(1, b * pages + 1, device="cuda").view(b, pages)
        lens = torch.full((b,), ctx, device="cuda")
        q = torch.randn(b, heads, width, dtype=torch.bfloat16, device="cuda")
        t = cuda_time(
            lambda q=q, cache=cache, table=table, lens=lens: triton_mla_decode(
                q, cache, table, lens, kv_lora, 0.1
            ),
            50,
        )
        nbytes = b * ctx * width * 2
        out[f"b{b}_ctx{ctx}"] = {
            "us": t * 1e6,
            "GBps": nbytes / t / 1e9,
            "bound_us": nbytes / bw * 1e6,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    ap.add_argument(
        "--layers", type=int, default=6, help="decoder layers (V3 has 61; 6 fit one H200)"
    )
    ap.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}"
    )
    args = ap.parse_args()
    chosen = set(args.sections.split(","))
    if chosen - set(SECTIONS):
        ap.error(
            f"--sections: unknown {sorted(chosen - set(SECTIONS))}; choose from {SECTIONS}"
        )
    if args.layers < 2:
        ap.error("--layers must be >= 2 (a dense layer and a MoE layer)")
    new_tokens = 16 if args.quick else NEW_TOKENS
    out_dir = Path(os.environ.get("OUT", "."))
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
    }
    errors: dict[str, str] = {}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            res[name] = value = fn()
            print(
                f"[{name}] {time.perf_counter() - t0:.1f}s {json.dumps(value, default=str)[:600]}",
                flush=True,
            )
            return value
        except Exception:
            errors[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{errors[name]}", flush=True)
            return None
        finally:
            (out_dir / "deepseek.json").write_text(
                json.dumps({**res, "errors": errors}, indent=1, default=str)
            )

    ceil = section("ceilings", ceilings) if "ceilings" in chosen else None
    bw = (ceil or {}).get("copy_GBps", 4200.0) * 1e9
    if "kernel" in chosen:
        section("mla_kernel", lambda: kernel_bench(bw))
    if "decode" in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            config = WorkerConfig(
                model=ModelConfig(
                    path=str(model_dir(args.layers, Path(tmp))),
                    load_format="dummy",
                    max_model_len=4096,
                ),
                cache=CacheConfig(
                    page_size=64, max_total_tokens=MAX_NUM_SEQS * (PROMPT_LEN + NEW_TOKENS) * 2
                ),
                scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, chunked_prefill_size=8192),
                parallel=ParallelConfig(device="cuda"),
            )
            t0 = time.perf_counter()
            engine = Engine(config)
            res["load_s"] = time.perf_counter() - t0
            engine.warm_up()
            res["weight_GB"] = (
                sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 1e9
            )
            for b in (1, 64):
                ctx = PROMPT_LEN + new_tokens / 2

                def decode(b: int = b, ctx: float = ctx) -> dict[str, Any]:
                    need = step_bytes(engine, b, ctx)
                    return {
                        "tok_s": decode_rate(engine, b, new_tokens, b),
                        "roofline_tok_s": b / (need["total"] / bw),
                        "step_bytes": need,
                    }

                section(f"decode_b{b}", decode)
    print("\n== summary (one process) ==")
    if ceil:
        print(
            f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, "
            f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s"
        )
    print(
        f"DeepSeek-V3 shape, {args.layers} layers, "
        f"dummy bf16 weights {res.get('weight_GB', 0):.1f} GB"
    )
    for b in (1, 64):
        d = res.get(f"decode_b{b}")
        if d:
            print(
                f"decode b{b:<3} {d['tok_s']:9.1f} tok/s   roofline {d['roofline_tok_s']:9.1f}   "
                f"{100 * d['tok_s'] / d['roofline_tok_s']:5.1f}%"
            )
    for name, k in (res.get("mla_kernel") or {}).items():
        print(
            f"mla kernel {name:<12} {k['us']:8.1f} us  {k['GBps']:7.0f} GB/s  "
            f"(bound {k['bound_us']:.1f} us)"
        )


if __name__ == "__main__":
    main()
