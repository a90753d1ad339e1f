"""A block-scaled FP8 checkpoint's `quantization_config` (the DeepSeek-V3 / Qwen3-*-FP8
format), read without torch; worker/model/fp8.py loads and runs the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Fp8Error(ValueError):
    """An FP8 checkpoint or setting cannot be used; the message names the tensor or field."""


GPU_BLOCK_K = (32, 64, 128)  # weight_block_size[1] values the CUDA FP8 kernels take


@dataclass(frozen=True)
class BlockFp8Config:
    """config.json `quantization_config` of a block-scaled FP8 checkpoint (quant_method fp8)."""

    block_n: int = 128  # output features per scale row
    block_k: int = 128  # input features per scale column
    modules_to_not_convert: tuple[str, ...] = ()  # kept in the checkpoint dtype (e.g. lm_head)

    @property
    def gpu_kernels_take(self) -> bool:
        """Whether the CUDA FP8 kernels run these blocks: the Triton GEMM's K step and the
        activation quantizer's group are one scale block wide, so block_k must be a power of two
        (tl.arange), at least 32 (tl.dot over e4m3 refuses K < 32: measured on an H100, a block of
        16 failed to compile) and at most 128 (the widest run on a GPU; three stages
        of 128 x 256 e4m3 tiles per operand would near the H100's shared memory). Other blocks
        are dequantized at load (worker/model/loader.py `fp8_linears_here`)."""
        return self.block_k in GPU_BLOCK_K

    def for_module(self, *names: str) -> BlockFp8Config | None:
        """Self for a module whose checkpoint names are all quantized; None if any is skipped."""
        skipped = any(pat and pat in name for name in names for pat in self.modules_to_not_convert)
        return None if skipped else self


def parse_quantization_config(cfg: dict[str, Any] | None, source: str) -> BlockFp8Config | None:
    """config.json's `quantization_config` → BlockFp8Config; None without one. Anything but
    block-scaled e4m3 FP8 with dynamic activations is refused naming the field, but for
    llm-compressor's KV-cache-only config (unquantized weights: None, as without one)."""
    if not cfg:
        return None
    where = f"{source}: quantization_config"
    method = cfg.get("quant_method")
    if method == "compressed-tensors":
        _check_kv_cache_only(cfg, where)
        return None
    if method != "fp8":
        raise Fp8Error(
            f"{where}.quant_method {method!r} is not supported; Tandem loads block-scaled FP8 "
            "checkpoints (quant_method fp8, weight_block_size [128, 128]); convert others with "
            "models/make_fp8.py or serve the unquantized checkpoint"
        )
    # No block size means per-tensor scales: said first, before the fields that follow from it
    # (a per-tensor checkpoint's static activation_scheme).
    block = cfg.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise Fp8Error(
            f"{where}.weight_block_size must be two positive ints (e.g. [128, 128]), got "
            f"{block!r}; per-tensor FP8 checkpoints (one weight_scale per linear) are not "
            "supported: serve the unquantized checkpoint, or a block-scaled copy "
            "models/make_fp8.py makes of it"
        )
    if str(cfg.get("fmt", "e4m3")) != "e4m3":
        raise Fp8Error(f"{where}.fmt {cfg.get('fmt')!r} is not supported; only e4m3 weights are")
    if str(cfg.get("activation_scheme", "dynamic")) != "dynamic":
        raise Fp8Error(
            f"{where}.activation_scheme {cfg.get('activation_scheme')!r} is not supported; "
            "only dynamic (per-token-group) activation scaling is"
        )
    if str(cfg.get("expert_dtype") or "fp8") != "fp8":  # transformers' FineGrainedFP8Config
        raise Fp8Error(
            f"{where}.expert_dtype {cfg.get('expert_dtype')!r} is not supported; only FP8 "
            "experts are: serve an FP8 or unquantized copy of the checkpoint"
        )
    skip = cfg.get("modules_to_not_convert") or cfg.get("ignored_layers") or []
    return BlockFp8Config(
        block_n=int(block[0]), block_k=int(block[1]), modules_to_not_convert=tuple(skip)
    )


def _check_kv_cache_only(cfg: dict[str, Any], where: str) -> None:
    """llm-compressor's KV-cache-only recipe (compressed-tensors, no `config_groups`, an FP8
    `kv_cache_scheme`): the weights are unquantized and the K/V scales are
    `self_attn.k_scale` / `v_scale` tensors, which the loader reads (worker/model/fp8.py
    `KVScales`); vLLM serves it the same way. Anything that quantizes weights is refused."""
    if cfg.get("config_groups"):
        raise Fp8Error(
            f"{where}.config_groups (compressed-tensors weight quantization) is not supported; "
            "Tandem loads block-scaled FP8 checkpoints (quant_method fp8, weight_block_size "
            "[128, 128]); convert the unquantized checkpoint with models/make_fp8.py"
        )
    kv = cfg.get("kv_cache_scheme") or {}
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8):
        raise Fp8Error(
            f"{where}.kv_cache_scheme ({kv.get('type')!r}, {kv.get('num_bits')} bits) is not "
            "supported; only FP8 K/V scales (type float, num_bits 8) are, with "
            "--kv-cache-dtype fp8_e4m3"
        )
