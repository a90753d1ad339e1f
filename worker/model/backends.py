"""Which attention backend a device gets: the one place that knows every backend.

Apart from worker/model/attention.py (the interface and the CPU reference) so the interface
imports no backend and each backend imports only the interface.
"""

from __future__ import annotations

import torch

from worker.model import fused
from worker.model.attention import AttentionBackend, TorchSDPABackend
from worker.model.triton_attention import TritonPagedBackend


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """Triton paged kernels on CUDA (when triton is installed), the SDPA reference elsewhere.
    One instance per model: it caches per-batch index tensors."""
    if fused.available(device):  # CUDA with triton importable
        return TritonPagedBackend()
    return TorchSDPABackend()
