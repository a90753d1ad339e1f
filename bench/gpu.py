"""GPU speed of the engine on one device, every compared figure from ONE process.

Measures, in order: the device's two ceilings (device-to-device copy GB/s, bf16 8192³ matmul
TFLOP/s); our Engine (worker.engine.Engine, dummy weights at the qwen3-8b shape, bf16, Triton
attention, fused Triton norm / RoPE / SiLU·mul kernels, CUDA-graph decode, overlapped decode
steps) at decode batch 1, 8, 64 next to the bandwidth roofline; at batch 1 and 64 also without
overlap (plain steps), eager (no graphs), and graphed with the
torch reference ops instead of the fused kernels at batch 1 and 64; an 8k-token prefill and its
MFU; a torch.profiler look at decode steps; then the same shape through transformers'
`generate` with its static cache. Prints a short table last and writes gpu.json to $OUT (or
the current directory). `--sections` runs a subset (the engine is built whenever one needs it).

    python3 bench/gpu.py [--quick] [--sections decode,unfused,profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig  # noqa: E402
from worker.engine import Engine, RequestOutput  # noqa: E402
from worker.request import Request  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

MODEL_DIR = ROOT / "bench" / "models" / "qwen3-8b-shape"
PROMPT_LEN, NEW_TOKENS = 512, 128
PREFILL_LEN = 8192
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 16384
SECTIONS = (
    "ceilings",
    "decode",
    "nooverlap",
    "eager",
    "unfused",
    "prefill",
    "profile",
    "transformers",
)


def cuda_time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call, by CUDA events around `iters` calls after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def ceilings() -> dict[str, float]:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 10)
    copy_gbs = 2 * src.numel() / t / 1e9  # bytes read + written
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: a @ b, 20)
    return {"copy_GBps": copy_gbs, "matmul_TFLOPs": 2 * 8192**3 / t / 1e12}


def model_sizes(engine: Engine) -> dict[str, float]:
    """Bytes read per decode step for weights (the embedding table is only gathered) and FLOPs."""
    model = engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    layer_params = sum(
        p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2
    )
    return {
        "weight_bytes_per_step": float(total - embed.numel() * embed.element_size()),
        "layer_matmul_params": float(layer_params),
        "total_params": float(sum(p.numel() for p in model.parameters())),
    }


def kv_bytes_per_token(engine: Engine) -> int:
    s = engine.kv.shape
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """Submit, step to completion. Returns (seconds until every request had its first token,
    seconds from then until all finished)."""
    first: set[str] = set()
    done: set[str] = set()

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            if out.error:
                raise RuntimeError(out.error)
            if out.token_ids:
                first.add(rid)
            if out.finished:
                done.add(rid)

        return sink

    tag = random.random()
    for i, p in enumerate(prompts):
        rid = f"b{i}-{tag}"
        engine.submit(
            Request(
                rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            ),
            sink_for(rid),
        )
    t0 = time.perf_counter()
    while len(first) < len(prompts):
        engine.step()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    while len(done) < len(prompts):
        engine.step()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def decode_rate(engine: Engine, batch: int, new_tokens: int, seed: int) -> float:
    prompts = random_prompts(batch, PROMPT_LEN, engine.spec.vocab_size, seed)
    _, t_decode = run_requests(engine, prompts, new_tokens)
    return batch * (new_tokens - 1) / t_decode


def profile_decode(
    engine: Engine, batch: int, steps: int, prompt_len: int = PROMPT_LEN
) -> dict[str, Any]:
    """Wall time per decode step vs GPU kernel time per step, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts(batch, prompt_len, engine.spec.vocab_size, 1000 + batch)
    tag = random.random()
    for i, p in enumerate(prompts):
        engine.submit(
            Request(
                f"p{i}-{tag}",
                p,
                SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True),
            ),
            lambda out: None,
        )
    for _ in range(8):  # prefill (up to four 8k chunks) + a few decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    while engine.has_pending_work():
        engine.step()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    gpu_us = sum(e.self_device_time_total for e in events) / steps
    return {
        "batch": batch,
        "step_wall_ms": wall * 1e3,
        "gpu_kernel_ms_per_step": gpu_us / 1e3,
        "gpu_idle_fraction": max(0.0, 1 - gpu_us / 1e3 / (wall * 1e3)),
        "kernels_per_step": sum(e.count for e in events) / steps,
        "top_kernels_ms_per_step": [  # (name, ms a step, launches a step)
            (e.key[:70], e.self_device_time_total / steps / 1e3, e.count / steps)
            for e in events[:14]
        ],
    }


def transformers_baseline(batches: list[int], new_tokens: int) -> dict[str, Any]:
    """The same shape through transformers' generate with its static cache, eager (compile
    disabled: its automatic compile of static-cache decode took longer than this bench's whole
    time budget on 2026-11-29, and compile + reduce-overhead crashed before, see gpu.md)."""
    import transformers

    cfg = transformers.Qwen3Config(**json.loads((MODEL_DIR / "config.json").read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cuda").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(
        config=cfg, device="cuda"
    )  # real inv_freq
    out: dict[str, Any] = {"transformers": transformers.__version__}
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, PROMPT_LEN), device="cuda")

        def gen(n: int, ids: torch.Tensor = ids) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
                disable_compile=True,
            )  # 5.x auto-compiles static-cache decode: minutes
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        gen(2)  # warm-up: cache allocation, kernels
        t1, tn = gen(1), gen(new_tokens)
        out[f"decode_tok_s_b{b}"] = b * (new_tokens - 1) / (tn - t1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    args = ap.parse_args()
    chosen = set(args.sections.split(","))
    if chosen - set(SECTIONS):
        ap.error(
            f"--sections: unknown {sorted(chosen - set(SECTIONS))}; choose from "
            f"{','.join(SECTIONS)}"
        )
    new_tokens = 32 if args.quick else NEW_TOKENS
    out_dir = Path(os.environ.get("OUT", "."))
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    errors: dict[str, str] = {}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
            res[name] = value
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
            (out_dir / "gpu.json").write_text(
                json.dumps({**res, "errors": errors}, indent=1, default=str)
            )

    ceil = section("ceilings", ceilings) if "ceilings" in chosen else None
    if chosen <= {"ceilings", "transformers"}:
        if "transformers" in chosen:
            section("transformers", lambda: transformers_baseline([1, 64], min(new_tokens, 33)))
        return
    config = WorkerConfig(
        model=ModelConfig(path=str(MODEL_DIR), load_format="dummy", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(
            page_size=16,
            max_total_tokens=MAX_NUM_SEQS * (PROMPT_LEN + NEW_TOKENS) + PREFILL_LEN * 2,
        ),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, chunked_prefill_size=PREFILL_LEN),
        parallel=ParallelConfig(device="cuda"),
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    res["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warm_up()  # captures the decode CUDA graphs too
    res["warm_up_and_graph_capture_s"] = time.perf_counter() - t0
    sizes = model_sizes(engine)
    res["sizes"] = sizes
    kv_tok = kv_bytes_per_token(engine)
    bw = (ceil or {}).get("copy_GBps", 4200.0) * 1e9

    def roofline(b: int) -> float:
        avg_ctx = PROMPT_LEN + new_tokens / 2
        return b / ((sizes["weight_bytes_per_step"] + b * avg_ctx * kv_tok) / bw)

    for b in (1, 8, 64) if "decode" in chosen else ():
        section(
            f"decode_b{b}",
            lambda b=b: {
                "tok_s": decode_rate(engine, b, new_tokens, b),
                "roofline_tok_s": roofline(b),
            },
        )
    if "nooverlap" in chosen:  # plain steps: the host reads each step's tokens before the next
        engine.overlap = False
        for b in (1, 64):
            section(
                f"decode_nooverlap_b{b}",
                lambda b=b: {"tok_s": decode_rate(engine, b, new_tokens, 300 + b)},
            )
        engine.overlap = True
    graphs = engine.runner.decode_graphs
    engine.runner.decode_graphs = None  # eager for comparison
    for b in (1, 64) if "eager" in chosen else ():
        section(
            f"decode_eager_b{b}",
            lambda b=b: {"tok_s": decode_rate(engine, b, min(new_tokens, 32), 100 + b)},
        )
    if "unfused" in chosen:  # graphs over the torch reference ops: what the fused kernels bring
        engine.model.set_fused_kernels(False)  # type: ignore[operator]
        t0 = time.perf_counter()
        engine.runner.enable_cuda_graphs(MAX_NUM_SEQS, engine.max_model_len)
        res["unfused_graph_capture_s"] = time.perf_counter() - t0
        for b in (1, 64):
            section(
                f"decode_unfused_b{b}",
                lambda b=b: {"tok_s": decode_rate(engine, b, new_tokens, 200 + b)},
            )
        engine.model.set_fused_kernels(True)  # type: ignore[operator]
    engine.runner.decode_graphs = graphs

    def prefill() -> dict[str, float]:
        times = []
        for seed in (7, 8):  # the first also warms up the SDPA / GEMM shapes
            prompts = random_prompts(1, PREFILL_LEN, engine.spec.vocab_size, seed)
            t_first, _ = run_requests(engine, prompts, 1)
            times.append(t_first)
        t = times[-1]
        cfgm = engine.spec
        attn_flops = 4 * (PREFILL_LEN**2 / 2) * cfgm.head_dim * cfgm.num_heads * cfgm.num_layers
        flops = 2 * sizes["layer_matmul_params"] * PREFILL_LEN + attn_flops
        mm = (ceil or {}).get("matmul_TFLOPs", 795.0)
        return {
            "tok_s": PREFILL_LEN / t,
            "seconds": t,
            "TFLOPs": flops / t / 1e12,
            "MFU_vs_measured_matmul": flops / t / 1e12 / mm,
        }

    if "prefill" in chosen:
        section("prefill_8k", prefill)
    if "profile" in chosen:
        section("profile_b1", lambda: profile_decode(engine, 1, 20))
        section("profile_b8", lambda: profile_decode(engine, 8, 20))
        section("profile_b64", lambda: profile_decode(engine, 64, 10))
    if "transformers" in chosen:  # our engine stays loaded (16 GB + KV): the GPU holds both models
        section("transformers", lambda: transformers_baseline([1, 64], min(new_tokens, 33)))

    # ---- the table -------------------------------------------------------------------------
    print("\n== summary (one process) ==")
    if ceil:
        print(
            f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, "
            f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s"
        )
    print(
        f"load {res.get('load_s', 0):.1f}s, warm-up + graph capture "
        f"{res.get('warm_up_and_graph_capture_s', 0):.1f}s"
    )
    hf = res.get("transformers") or {}
    print(
        f"{'decode':<10}{'tok/s':>10}{'roofline':>10}{'%roof':>8}{'no-ovl':>10}{'eager':>10}{'unfused':>10}"
        f"{'HF':>10}{'x HF':>8}"
    )
    for b in (1, 8, 64):
        d = res.get(f"decode_b{b}")
        if not d:
            continue
        plain, eager, unfused = (
            (res.get(f"decode_{k}_b{b}") or {}).get("tok_s", float("nan"))
            for k in ("nooverlap", "eager", "unfused")
        )
        base = hf.get(f"decode_tok_s_b{b}", float("nan"))
        print(
            f"{'b' + str(b):<10}{d['tok_s']:>10.1f}{d['roofline_tok_s']:>10.1f}"
            f"{100 * d['tok_s'] / d['roofline_tok_s']:>7.1f}%"
            f"{plain:>10.1f}{eager:>10.1f}{unfused:>10.1f}"
            f"{base:>10.1f}{d['tok_s'] / base:>8.1f}"
        )
    p = res.get("prefill_8k")
    if p:
        print(
            f"prefill 8k: {p['tok_s']:.0f} tok/s, {p['TFLOPs']:.0f} TFLOP/s, MFU "
            f"{100 * p['MFU_vs_measured_matmul']:.1f}%"
        )
    for key in ("profile_b1", "profile_b8", "profile_b64"):
        pr = res.get(key)
        if pr:
            print(
                f"{key}: step {pr['step_wall_ms']:.2f} ms, GPU kernels "
                f"{pr['gpu_kernel_ms_per_step']:.2f} ms (idle {100 * pr['gpu_idle_fraction']:.0f}%)"
            )
    if errors:
        print("errors in:", ", ".join(errors))


if __name__ == "__main__":
    main()
