"""Weight bytes of a checkpoint as a worker will hold them, for `tandem plan` (no torch import).

Read from the safetensors headers (exact: every tensor's dtype and shape), or estimated from
config.json when there are none (`load_format: dummy` shape directories). The dtype a worker
holds a tensor in: the model dtype (`model.dtype`, or the checkpoint's), except a block-scaled
FP8 checkpoint's linear weights on CUDA, which stay one byte per element plus their float32
block scales (but those `dequantized_on_gpu` names); on the CPU those are dequantized at load to
the model dtype (worker/model/fp8.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import ClusterConfigError
from worker.arch.fp8_config import GPU_BLOCK_K

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
_SCALE_INV = "_scale_inv"


@dataclass(frozen=True)
class WeightBytes:
    total: int  # bytes of every weight of one replica (all its TP ranks together)
    dtype: str  # what the linears are held in: e.g. "bfloat16" or "float8_e4m3fn + bfloat16"
    exact: bool  # from the safetensors headers (True) or estimated from config.json (False)


# FP8 checkpoint tensors a CUDA worker still dequantizes at load to the model dtype: routed MoE
# experts (the MoE kernels run the model dtype; Qwen3-MoE and DeepSeek-V3), MLA's kv_b_proj
# (absorbed per head) and DeepSeek's MTP eh_proj (worker/model/deepseek_v3.py).
_DEQUANTIZED = (".mlp.experts.", ".self_attn.kv_b_proj.", ".eh_proj.")


# Qwen3-Next builds FP8 linears only for its shared experts (llama.MLP); its gated attention,
# linear attention and shared-expert gate take the model dtype (worker/model/qwen3_next.py).
_FP8_ONLY = {"Qwen3NextForCausalLM": (".shared_expert.",)}


def dequantized_on_gpu(name: str, architecture: str = "") -> bool:
    """Whether an FP8 checkpoint weight `name` of `architecture` is held in the model dtype even
    on CUDA."""
    only = _FP8_ONLY.get(architecture)
    if only is not None and not any(part in name for part in only):
        return True
    return any(part in name for part in _DEQUANTIZED)


def _headers(path: Path) -> dict[str, dict[str, Any]]:
    """Every tensor's header entry ({dtype, shape, ...}) across the checkpoint's files; a file
    cut short or not safetensors at all is one line naming it (ClusterConfigError)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            try:
                header = json.loads(fh.read(n)) if 0 < n <= size - 8 else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                header = None
        if not isinstance(header, dict):
            raise ClusterConfigError(f"{f}: not a safetensors file ({size} bytes, header length "
                                     f"{n}); re-download it")
        out.update({k: v for k, v in header.items() if k != "__metadata__"})
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _estimated_params(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(linear weight elements of the decoder layers but the routed experts, the routed experts'
    elements, all other elements) from config.json: the dense Llama/Qwen shape, MoE experts
    where config.json names them."""
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    vocab = int(hf["vocab_size"])
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts:
        mlp, routed = 0, 3 * hidden * int(hf["moe_intermediate_size"]) * experts
        router = hidden * experts
    else:
        mlp, routed, router = 3 * hidden * int(hf["intermediate_size"]), 0, 0
    embeddings = vocab * hidden * (1 if hf.get("tie_word_embeddings") else 2)
    norms = layers * (2 * hidden + 2 * head_dim) + hidden
    return layers * (attn + mlp), layers * routed, embeddings + norms + layers * router


def weight_bytes(
    model_path: str, hf: dict[str, Any], dtype: str, device: str
) -> WeightBytes | None:
    """The weights one replica holds with compute dtype `dtype` on `device` (cpu | cuda...);
    None when there are no safetensors and config.json lacks a shape field to estimate from."""
    item = DTYPE_BYTES.get(dtype, 4)
    # Only block-scaled FP8 (quant_method fp8) has FP8 linears, and only with a block_k the FP8
    # kernels take (else dequantized at load: loader.fp8_linears_here); llm-compressor's
    # KV-cache-only config (compressed-tensors) leaves the weights unquantized.
    quant = hf.get("quantization_config") or {}
    block = quant.get("weight_block_size") or [0, 0]
    fp8_kept = (
        device.startswith("cuda")
        and quant.get("quant_method") == "fp8"
        and block[-1] in GPU_BLOCK_K
    )
    held = f"float8_e4m3fn + {dtype}" if fp8_kept else dtype
    headers = _headers(Path(model_path))
    if not headers:
        try:
            linear, routed, other = _estimated_params(hf)
        except (KeyError, TypeError, ValueError):
            return None
        per_block = 1 / max(1, block[0] * block[1]) if fp8_kept else 0  # a float32 scale a block
        linear_bytes = int(linear * (1 + 4 * per_block)) if fp8_kept else linear * item
        # routed experts: the model dtype on every device (dequantized_on_gpu)
        return WeightBytes(linear_bytes + (routed + other) * item, held, exact=False)
    total = 0
    arch = (hf.get("architectures") or [""])[0]
    for name, entry in headers.items():
        n = _numel(entry["shape"])
        kept = fp8_kept and not dequantized_on_gpu(name.removesuffix(_SCALE_INV), arch)
        if name.endswith(_SCALE_INV):
            total += 4 * n if kept else 0  # block scales: kept with FP8 weights, else folded in
        elif str(entry["dtype"]).startswith("F8") and kept:
            total += n
        else:
            total += n * item
    return WeightBytes(total, held, exact=True)
