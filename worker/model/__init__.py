"""Model code: the Llama / Qwen2 / Qwen3 dense family over the paged KV cache, and its loader.

The engine uses three names: `load_model(model_cfg, parallel_cfg) -> (CausalLM, ModelSpec)`,
`CausalLM.forward(batch, kv) -> hidden [T, hidden]` and `CausalLM.compute_logits(hidden)`.
"""

from worker.arch.hf_config import SUPPORTED_ARCHITECTURES, ModelLoadError
from worker.model.attention import AttentionBackend, TorchSDPABackend, paged_attention
from worker.model.base import CausalLM, ModelSpec
from worker.model.loader import load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "CausalLM",
    "ModelLoadError",
    "ModelSpec",
    "TorchSDPABackend",
    "load_model",
    "paged_attention",
]
