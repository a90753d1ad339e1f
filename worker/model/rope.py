"""Rotary position embeddings with the scaling variants found in HF config.json files.

`RotaryEmbedding.cos_sin(positions, token_seq_lens)` is computed once per forward pass and
shared by every layer. Frequencies are always computed in float32 (as transformers does), and
q/k are rotated in float32 too, then cast back: the rotation is cheap and bf16 angles at
large positions lose precision.

Dynamic NTK scales the base from the request's context length, so it needs each token's
request length (`token_seq_lens`); other variants ignore it. Per request, not per batch, so a
request's numerics do not depend on what it is batched with. As transformers' one-pass prefill
and token-by-token decode do, a prompt token takes the whole prompt's length and a later token
its own (`batch_cos_sin`), so chunked prefill is exact too. A page of keys is only valid for the
request that computed it: dynamic models run without the prefix cache
(`ModelSpec.prefix_cache_exact`).
"""

from __future__ import annotations

import math

import torch

from worker.arch.hf_config import RopeConfig
from worker.batch import ForwardBatch


def _base_inv_freq(theta: float | torch.Tensor, dim: int, device: torch.device) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # [D/2]
    if isinstance(theta, torch.Tensor):
        return 1.0 / (theta[:, None] ** exponent[None, :])  # [T, D/2]
    return 1.0 / (theta**exponent)  # [D/2]


def _yarn_inv_freq(cfg: RopeConfig, dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, blend with a linear ramp in between."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = cfg.factor
    if cfg.attention_factor is not None:
        attention_factor = float(cfg.attention_factor)
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = mscale(factor, cfg.mscale) / mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times in the original context.
        orig = cfg.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2, device=device).float() / dim)  # [D/2]
    ramp = (
        (torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)
    ).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 = keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def _llama3_inv_freq(cfg: RopeConfig, dim: int, device: torch.device) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by factor, keep short ones, smooth in between."""
    inv_freq = _base_inv_freq(cfg.theta, dim, device)
    old_len = cfg.original_max_position_embeddings
    low_freq_wavelen = old_len / cfg.low_freq_factor
    high_freq_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (
        cfg.high_freq_factor - cfg.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE over the full head_dim."""

    def __init__(self, cfg: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.dim = head_dim
        device = torch.device(device)
        self.attention_factor = 1.0  # multiplies cos and sin (YaRN's attention temperature)
        if cfg.rope_type in ("default", "dynamic"):
            self.inv_freq = _base_inv_freq(cfg.theta, head_dim, device)
        elif cfg.rope_type == "linear":
            self.inv_freq = _base_inv_freq(cfg.theta, head_dim, device) / cfg.factor
        elif cfg.rope_type == "yarn":
            self.inv_freq, self.attention_factor = _yarn_inv_freq(cfg, head_dim, device)
        elif cfg.rope_type == "llama3":
            self.inv_freq = _llama3_inv_freq(cfg, head_dim, device)
        else:  # parse_rope already refused anything else
            raise AssertionError(cfg.rope_type)

    def _dynamic_inv_freq(self, token_seq_lens: torch.Tensor) -> torch.Tensor:
        """Dynamic NTK: per token, the base grows with its request's context length."""
        max_pos = self.cfg.max_position_embeddings
        length = token_seq_lens.clamp(min=max_pos).double()  # [T]
        factor = self.cfg.factor
        base = self.cfg.theta * ((factor * length / max_pos) - (factor - 1)) ** (
            self.dim / (self.dim - 2)
        )
        return _base_inv_freq(base.float(), self.dim, token_seq_lens.device)  # [T, D/2]

    def cos_sin(
        self, positions: torch.Tensor, token_seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, D] float32 (halves duplicated for rotate-half)."""
        inv_freq = self.inv_freq.to(positions.device)
        if self.cfg.rope_type == "dynamic":
            assert token_seq_lens is not None, "dynamic NTK RoPE needs each token's request length"
            freqs = positions.float()[:, None] * self._dynamic_inv_freq(token_seq_lens)  # [T, D/2]
        else:
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def batch_cos_sin(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for a forward batch's tokens; dynamic NTK reads each token's request
        length from the batch (every family goes through here, so none can forget it)."""
        token_seq_lens = None
        if self.cfg.rope_type == "dynamic":
            counts = batch.query_start[1:] - batch.query_start[:-1]  # [B]
            if batch.prompt_lens_list is None:
                token_seq_lens = torch.repeat_interleave(batch.seq_lens, counts)  # [T]
            else:  # transformers: a prompt token sees the prompt's length, a later one its own
                prompt_lens = torch.tensor(batch.prompt_lens_list, device=counts.device)  # [B]
                token_seq_lens = torch.maximum(batch.positions + 1,
                                               torch.repeat_interleave(prompt_lens, counts))
        return self.cos_sin(batch.positions, token_seq_lens)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D]; returns x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)  # rotate_half
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)
