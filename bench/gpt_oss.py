"""GPT-OSS decode speed on one GPU with dummy weights, next to its bandwidth roofline.

Shapes (bench/models/): gpt-oss-20b (all 24 layers, 41.8 GB in bf16) and gpt-oss-120b with 12
of its 36 layers (79 GB), both bfloat16 (not MXFP4), sliding window 128 on every other layer
kept in rings of pages, attention sinks, top-4 MoE. For each: our Engine (Triton paged
attention with sinks, fused norms, overlapped decode; no CUDA graphs, since routing picks
experts on the host) at decode batch 1 and 64 after 512-token prompts. Prints one line per run
and writes gpt_oss.json to $OUT (or the current directory).

    python3 bench/gpt_oss.py [--quick] [--shapes gpt-oss-20b-shape,gpt-oss-120b-12l-shape]

Roofline: a decode step reads the non-expert weights once (the embedding is only gathered),
each expert that some token of the batch picks (per layer, E * (1 - (1 - k/E)^B) of them in
expectation under uniform routing), and the KV of every full layer's whole context and of each
window layer's last W tokens; tokens per second = B / (bytes / copy bandwidth).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import ceilings, decode_rate  # noqa: E402
from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine  # noqa: E402

SHAPES = ("gpt-oss-20b-shape", "gpt-oss-120b-12l-shape")
PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS = 512, 128, 64
BATCHES = (1, 64)


def step_bytes(engine: Engine, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` requests at mean `context` tokens reads (module doc)."""
    from worker.model.gpt_oss import GptOssMoE

    model = engine.model
    experts, dense = 0.0, 0.0
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens"):
            continue
        dense += p.numel() * p.element_size()
    for module in model.modules():
        if isinstance(module, GptOssMoE):
            per_expert = sum(
                t[0].numel() * t.element_size()
                for t in (module.w13, module.w2, module.w13_bias, module.w2_bias)
            )
            e, k = module.num_experts, module.top_k
            touched = e * (1 - (1 - k / e) ** batch)
            dense -= per_expert * e
            experts += per_expert * touched
    s = engine.kv.shape
    layer_token = 2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize
    window_ctx = min(context, s.window) if s.window_layers else 0.0
    kv = batch * layer_token * (s.num_full_layers * context + len(s.window_layers) * window_ctx)
    return dense + experts + kv


def run_shape(name: str, new_tokens: int, bandwidth: float) -> dict[str, Any]:
    config = WorkerConfig(
        model=ModelConfig(
            path=str(ROOT / "bench" / "models" / name),
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=4096,
        ),
        cache=CacheConfig(
            page_size=16, max_total_tokens=MAX_NUM_SEQS * (PROMPT_LEN + NEW_TOKENS) * 2
        ),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, chunked_prefill_size=4096),
        parallel=ParallelConfig(device="cuda"),
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    engine.warm_up()
    out["params_B"] = sum(p.numel() for p in engine.model.parameters()) / 1e9
    out["window_layers"] = len(engine.kv.shape.window_layers)
    for b in BATCHES:
        tok_s = decode_rate(engine, b, new_tokens, seed=b)
        roof = b / (step_bytes(engine, b, PROMPT_LEN + new_tokens / 2) / bandwidth)
        out[f"decode_b{b}"] = {"tok_s": tok_s, "roofline_tok_s": roof, "of_roofline": tok_s / roof}
        print(
            f"{name} decode b={b}: {tok_s:.1f} tok/s, roofline {roof:.1f} tok/s "
            f"({100 * tok_s / roof:.1f}%)",
            flush=True,
        )
    engine.scheduler.assert_drained()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="32 new tokens per request (a smoke run)")
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated subset of the shapes"
    )
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {','.join(SHAPES)}")
    out_dir = Path(os.environ.get("OUT", "."))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ceilings": ceilings()}
    bandwidth = res["ceilings"]["copy_GBps"] * 1e9
    print(f"ceilings: {json.dumps(res['ceilings'])}", flush=True)
    for name in shapes:
        res[name] = run_shape(name, 32 if args.quick else NEW_TOKENS, bandwidth)
        (out_dir / "gpt_oss.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
