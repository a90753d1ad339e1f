"""FP8 in the engine: the KV cache in float8_e4m3fn, and block-scaled FP8 checkpoints.

KV cache (`cache.kv_cache_dtype: fp8_e4m3`): a page holds K and V as e4m3 (one byte per
element). Each layer has a K and a V scale, per tensor or per kv head, from the checkpoint
where it has them (vLLM / llm-compressor / ModelOpt names, `KV_SCALE_SUFFIXES`), else 1.0;
stored = clamp(x / scale, ±448) rounded to e4m3, read = stored · scale. The CPU reference
stores float8 and dequantizes to float32 on read (worker/model/attention.py); the Triton
kernels convert in registers and fold the scales into the softmax scale and the output
(worker/model/triton_decode.py, fused.py). `kv_scale_label` names the scales in the
worker's start-up log and in the layout contract, so prefill and decode with different scales
refuse to pair.

Weights (config.json `quantization_config`: quant_method fp8, e4m3, `weight_block_size`
[128, 128]; the DeepSeek-V3 / Qwen3-*-FP8 format): each quantized linear `X` has `X.weight`
[N, K] float8_e4m3fn and `X.weight_scale_inv` [ceil(N/128), ceil(K/128)] float32, and
weight[n, k] = X.weight[n, k] · X.weight_scale_inv[n // 128, k // 128]. `BlockFp8Source` pairs
the two: `read()` dequantizes any slice (the CPU path dequantizes at load), `read_quantized()`
hands a block-aligned slice and its scale rows/columns to a layer that keeps FP8 (CUDA:
worker/model/fp8_gemm.py and the GEMV). `quantize_blockwise` is the inverse, used by
models/make_fp8.py.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch

from worker.arch.fp8_config import BlockFp8Config, Fp8Error

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; stores saturate here
KV_CACHE_DTYPES = {"fp8_e4m3": FP8}  # cache.kv_cache_dtype → storage dtype ("auto": the model's)

# Checkpoint names of per-layer K/V cache scales: llm-compressor / compressed-tensors
# (`self_attn.k_scale`), ModelOpt (`self_attn.k_proj.k_scale`), and the older single
# `self_attn.kv_scale` for both. Each is a dequantization multiplier, per tensor ([] or [1]) or
# per kv head ([num_kv_heads]).
KV_SCALE_SUFFIXES = {
    "self_attn.k_scale": "k",
    "self_attn.v_scale": "v",
    "self_attn.k_proj.k_scale": "k",
    "self_attn.v_proj.v_scale": "v",
    "self_attn.kv_scale": "kv",
}
_KV_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.(" + "|".join(map(re.escape, KV_SCALE_SUFFIXES)) + r")$"
)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype KV pages are stored in: the model's for `auto`, else the named FP8 type."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise Fp8Error(
            f"cache.kv_cache_dtype {kv_cache_dtype!r} is not one of "
            f"auto|{'|'.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


# ---- the KV cache ------------------------------------------------------------------------------


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """x [T, Hkv, D] → stored [T, Hkv, D] in `dtype`: x / scale[h], saturated at ±448."""
    y = x.float() / scale.float()[:, None]  # scale: [Hkv]
    return y.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V [..., Hkv, L, D] → float32 values times their head's scale; a cache that is
    not FP8 (scale None) is only cast to `dtype`."""
    if scale is None:
        return x.to(dtype)
    return x.float() * scale.float()[:, None, None]  # scale: [Hkv]


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when `name` is a checkpoint's K/V cache scale, else None."""
    m = _KV_SCALE_NAME.match(name)
    return None if m is None else (int(m.group(1)), KV_SCALE_SUFFIXES[m.group(2)])


class KVScales:
    """The checkpoint's K/V cache scales, collected while it streams, then set on the layers.

    Scales are kept whole (every kv head) so each rank takes its own heads and every rank, of
    any TP size, labels them the same (`label`): the label goes into the layout contract.
    """

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.k: dict[int, torch.Tensor] = {}  # layer → [num_kv_heads] float32
        self.v: dict[int, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        target = kv_scale_target(name)
        assert target is not None, name
        layer, which = target
        flat = tensor.detach().float().reshape(-1)
        if flat.numel() not in (1, self.num_kv_heads) or layer >= self.num_layers:
            raise Fp8Error(
                f"{name}: a K/V cache scale must be one value or one per kv head "
                f"({self.num_kv_heads}) of one of {self.num_layers} layers; got shape "
                f"{tuple(tensor.shape)}"
            )
        if not bool(torch.isfinite(flat).all()) or bool((flat <= 0).any()):
            raise Fp8Error(
                f"{name}: K/V cache scales must be finite and > 0, got {flat.tolist()[:4]}"
            )
        full = flat.expand(self.num_kv_heads).clone()
        for side in ("k", "v") if which == "kv" else (which,):
            getattr(self, side)[layer] = full

    @property
    def found(self) -> bool:
        return bool(self.k or self.v)

    def label(self) -> str:
        """'1.0' (none in the checkpoint), else 'checkpoint per-tensor|per-head sha256:…' over
        every layer's K and V scales (1.0 where a layer has none)."""
        if not self.found:
            return "1.0"
        per_head = any(t.unique().numel() > 1 for t in (*self.k.values(), *self.v.values()))
        h = hashlib.sha256()
        for layer in range(self.num_layers):
            for side in (self.k, self.v):
                h.update(side.get(layer, torch.ones(self.num_kv_heads)).numpy().tobytes())
        return f"checkpoint {'per-head' if per_head else 'per-tensor'} sha256:{h.hexdigest()[:16]}"

    def keep(self, layers: set[int]) -> list[int]:
        """Drop the scales of layers outside `layers` (the ones whose attention takes scales:
        MLA latent pages, Qwen3-Next's and linear-attention layers do not), so `label` claims
        only scales in use; returns the dropped layers."""
        dropped = sorted((set(self.k) | set(self.v)) - layers)
        for layer in dropped:
            self.k.pop(layer, None)
            self.v.pop(layer, None)
        return dropped

    def local(self, side: str, layer: int, heads: list[int]) -> torch.Tensor:
        """This rank's scales [len(heads)] for one layer's K ("k") or V ("v"); 1.0 if absent."""
        full = getattr(self, side).get(layer)
        return torch.ones(len(heads)) if full is None else full[heads]


# ---- block-scaled FP8 weights -----------------------------------------------------------------


def quantize_blockwise(
    w: torch.Tensor, block_n: int = 128, block_k: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (FP8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32) with
    w ≈ fp8 · scale_inv per block; each block's largest |value| maps to 448 (a zero block: 1)."""
    n, k = w.shape
    rows, cols = -(-n // block_n), -(-k // block_k)
    padded = torch.zeros(rows * block_n, cols * block_k, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, block_n, cols, block_k)  # [R, bn, C, bk]
    amax = blocks.abs().amax(dim=(1, 3))  # [R, C]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * block_n, cols * block_k)[:n, :k].contiguous(), scale_inv


def _expand(
    scale: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
) -> torch.Tensor:
    """The per-element scales of weight rows [r0, r1) × cols [c0, c1) from the block grid."""
    (r0, r1), (c0, c1), (bn, bk) = rows, cols, block
    grid = scale[r0 // bn : -(-r1 // bn), c0 // bk : -(-c1 // bk)].float()
    full = grid.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return full[r0 - (r0 // bn) * bn :][: r1 - r0, c0 - (c0 // bk) * bk :][:, : c1 - c0]


class BlockFp8Source:
    """A checkpoint weight in FP8 with its block scales, as a `TensorSource`
    (worker/model/weights.py)."""

    def __init__(self, name: str, weight: Any, scale: Any, config: BlockFp8Config) -> None:
        self.name = name
        self._w, self._s = weight, scale  # TensorSources of X.weight and X.weight_scale_inv
        self.block = (config.block_n, config.block_k)
        n, k = self.shape
        want = (-(-n // config.block_n), -(-k // config.block_k))
        if len(self.shape) != 2 or tuple(scale.shape) != want:
            raise Fp8Error(
                f"{name}_scale_inv has shape {tuple(scale.shape)}, but a weight of shape "
                f"{self.shape} with weight_block_size {list(self.block)} needs {want}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._w.shape)

    def _range(
        self, dim: int, start: int, stop: int | None
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        n, k = self.shape
        stop = self.shape[dim] if stop is None else stop
        return ((start, stop), (0, k)) if dim == 0 else ((0, n), (start, stop))

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The dequantized slice (float32): what the layer would hold unquantized."""
        rows, cols = self._range(dim, start, stop)
        w = self._w.read(dim, start, stop).float()
        return w * _expand(self._s.read(), rows, cols, self.block)

    def read_quantized(
        self, dim: int, start: int = 0, stop: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 slice, its scale rows or columns) of a slice that starts on a block boundary."""
        b = self.block[dim]
        stop = self.shape[dim] if stop is None else stop
        if start % b or (stop % b and stop != self.shape[dim]):
            raise Fp8Error(
                f"{self.name}: slice [{start}, {stop}) of dim {dim} does not start and end on "
                f"{b}-wide scale blocks; this layer must be dequantized (tensor parallel size?)"
            )
        return self._w.read(dim, start, stop), self._s.read(dim, start // b, -(-stop // b))


def dequantize_weight(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 w [N, K] and its block scales → the weight in `dtype` (the GEMM/GEMV reference)."""
    n, k = w.shape
    return (w.float() * _expand(scale_inv, (0, n), (0, k), block)).to(dtype)
