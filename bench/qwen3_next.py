"""Qwen3-Next decode speed with dummy weights: the model driven directly (no engine yet).

The engine's recurrent-state cache group is not wired yet, so this drives
`Qwen3NextForCausalLM` the way the engine will: pages for the full-attention layers, one state
slot per request in the KV cache's state region, hand-built ForwardBatches. It loads
bench/models/qwen3-next-80b-shape with `--layers` layers (the 3:1 DeltaNet:attention pattern
kept), prefills `--prompt` tokens per request, then times `--steps` greedy decode steps at each
batch size (forward, logits, argmax, batch building: the whole step) next to a roofline: the
bytes one step must read (weights, the routed experts the batch touches, KV, the state read and
written) over the device's copy bandwidth. First it times one DeltaNet layer's delta rule both
ways at the model's head shapes — the Triton fused recurrent kernel and the torch chunked
reference — for a long prefill chunk and for a decode batch (which to use for long prefills is
open). Prints one line per measurement and writes qwen3_next.json to $OUT (or the current
directory).

    python -m bench.qwen3_next                      # H200: 24 layers, batch 1 and 64
    python -m bench.qwen3_next --device cpu --tiny  # a CPU smoke run at tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from worker.batch import ForwardBatch
from worker.config import ModelConfig, ParallelConfig
from worker.kv_cache import KVCache, KVShape
from worker.model import gated_delta, gated_delta_triton, load_model
from worker.model.base import CausalLM, ModelSpec

SHAPE = Path(__file__).resolve().parent / "models" / "qwen3-next-80b-shape" / "config.json"
TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, vocab_size=256)
PAGE = 16


class Driver:
    """Pages and state slots for `batch` requests of up to `max_len` tokens, on the device."""

    def __init__(self, model: CausalLM, spec: ModelSpec, batch: int, max_len: int,
                 device: torch.device) -> None:
        self.model, self.device = model, device
        pages_per = -(-max_len // PAGE)
        self.kv = KVCache(KVShape(batch * pages_per + 1, spec.num_layers, spec.num_kv_heads, PAGE,
                                  spec.head_dim, spec.dtype, state_layers=spec.state_layers,
                                  state=spec.state_shape, num_state_slots=batch), device)
        # request i: pages 1 + i*pages_per .., state slot i (zeroed: every request starts at 0)
        self.table = torch.arange(batch * pages_per, device=device).view(batch, pages_per) + 1
        self.lens = [0] * batch

    def step(self, tokens: list[list[int]]) -> torch.Tensor:
        """Each request's next tokens → each request's greedy next token [B] (on the device)."""
        ids, pos, qs, slots = [], [], [0], []
        for i, toks in enumerate(tokens):
            start = self.lens[i]
            ids += toks
            pos += range(start, start + len(toks))
            qs.append(qs[-1] + len(toks))
            row = self.table[i].tolist()
            slots += [row[p // PAGE] * PAGE + p % PAGE for p in range(start, start + len(toks))]
            self.lens[i] += len(toks)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(pos, device=dev),
            query_start=torch.tensor(qs, device=dev), seq_lens=torch.tensor(self.lens, device=dev),
            page_table=self.table, slot_mapping=torch.tensor(slots, device=dev),
            logits_indices=torch.tensor(qs[1:], device=dev) - 1, query_start_list=qs,
            seq_lens_list=list(self.lens), state_slots=torch.arange(len(tokens), device=dev),
        )
        hidden = self.model(batch, self.kv)  # [T, hidden]
        return self.model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1)  # [B]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read + write), the roofline's ceiling."""
    size = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 5 / (time.perf_counter() - t0)


def rule_times(
    cfg: dict[str, Any], device: torch.device, prefill_len: int, decode_batch: int
) -> dict[str, float]:
    """ms of one layer's delta rule, torch chunked vs Triton: a prefill chunk, a decode step."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    out: dict[str, float] = {}
    for case, lengths in (("prefill", [prefill_len]), ("decode", [1] * decode_batch)):
        t = sum(lengths)
        q, k = (torch.randn(t, hk, dk, device=device) for _ in range(2))
        v = torch.randn(t, hv, dv, device=device)
        g, beta = -torch.rand(t, hv, device=device), torch.rand(t, hv, device=device)
        ssm = torch.zeros(len(lengths), hv, dk, dv, device=device)
        slots = torch.arange(len(lengths), device=device)
        qs = [0]
        for n in lengths:
            qs.append(qs[-1] + n)
        inputs = (q, k, v, g, beta, ssm, slots, torch.tensor(qs, device=device), qs)
        ops: list[tuple[str, Any]] = [("torch", gated_delta)]
        if device.type == "cuda":
            ops.append(("triton", gated_delta_triton))
        for name, mod in ops:
            mod.gated_delta_rule(*inputs)  # warm-up (and Triton's compile)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(3):
                mod.gated_delta_rule(*inputs)
            sync(device)
            out[f"{case}_{name}_ms"] = (time.perf_counter() - t0) / 3 * 1e3
    return out


def step_bytes(
    model: CausalLM, cfg: dict[str, Any], spec: ModelSpec, batch: int, ctx: int
) -> float:
    """Bytes one decode step reads (and the state it writes): weights outside the experts (the
    embedding only gathered), the routed experts the batch's tokens touch (uniform routing,
    as dummy routers are), the full layers' KV of `ctx` tokens, the state read and written."""
    expert_bytes = 0
    other = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".experts.w" in name:
            expert_bytes += size
        elif "embed_tokens" not in name:
            other += size
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    touched = 1 - (1 - k / e) ** batch  # the share of experts at least one token picks
    full_layers = spec.num_layers - len(spec.state_layers)
    kv_bytes = full_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize * ctx
    st = spec.state_shape
    state = len(spec.state_layers) * (st.conv_bytes + st.ssm_bytes) if st is not None else 0
    return other + expert_bytes * touched + batch * (kv_bytes + 2 * state)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24, help="num_hidden_layers (multiple of 4)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run)")
    args = ap.parse_args()
    if args.layers <= 0 or args.layers % 4:
        ap.error(f"--layers {args.layers}: use a positive multiple of 4 (3 DeltaNet + 1 attention)")
    device = torch.device(args.device)
    cfg = {**json.loads(SHAPE.read_text()), "num_hidden_layers": args.layers}
    if args.tiny:
        cfg.update(TINY, torch_dtype="float32")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    res: dict[str, Any] = {"device": name, "layers": args.layers, "prompt": args.prompt,
                           "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        model, spec = load_model(ModelConfig(path=tmp, load_format="dummy"),
                                 ParallelConfig(device=args.device))
        res["load_s"] = time.perf_counter() - t0
    bw = copy_bandwidth(device)
    res["copy_GBps"] = bw / 1e9
    with torch.no_grad():
        res["delta_rule"] = rule_times(cfg, device, 256 if args.tiny else 4096, 64)
    times = ", ".join(f"{k} {v:.2f}" for k, v in res["delta_rule"].items())
    print(f"delta rule, one layer: {times}", flush=True)
    rng = random.Random(0)
    for b in (int(x) for x in args.batches.split(",")):
        driver = Driver(model, spec, b, args.prompt + args.steps + 1, device)
        prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(args.prompt)] for _ in range(b)]
        with torch.no_grad():
            sync(device)
            t0 = time.perf_counter()
            nxt = driver.step(prompts)
            sync(device)
            prefill_s = time.perf_counter() - t0
            driver.step([[t] for t in nxt.tolist()])  # warm the decode path
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                nxt = driver.step([[t] for t in nxt.tolist()])
            sync(device)
            step_s = (time.perf_counter() - t0) / args.steps
        roof = b / (step_bytes(model, cfg, spec, b, args.prompt + args.steps // 2) / bw)
        row = {"tok_s": b / step_s, "step_ms": step_s * 1e3, "roofline_tok_s": roof,
               "prefill_tok_s": b * args.prompt / prefill_s}
        res[f"decode_b{b}"] = row
        print(f"batch {b}: {row['tok_s']:.1f} tok/s ({row['step_ms']:.2f} ms/step), roofline "
              f"{roof:.0f} tok/s ({row['tok_s'] / roof:.1%}); "
              f"prefill {row['prefill_tok_s']:.0f} tok/s", flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "qwen3_next.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
