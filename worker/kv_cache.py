"""The KV cache memory of one worker rank: one tensor, page-major.

Layout: `data[num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]`.

Why page-major: a page holds every layer's K and V for `page_size` tokens in one contiguous
run of bytes, so shipping a prompt to a decode worker is one transfer range per run of
consecutive pages, whatever the layer count. Heads are outer to tokens inside a page so that
a head slice of one (layer, K|V) is contiguous too — heterogeneous TP moves head slices.
The whole tensor is registered with the transfer backend once, at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_pages: int
    num_layers: int
    num_kv_heads: int  # on this rank
    page_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.page_size * self.head_dim * self.dtype.itemsize


class KVCache:
    """Owns the paged KV tensor; hands out per-layer views for attention."""

    def __init__(self, shape: KVShape, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        # data: [num_pages, num_layers, 2, num_kv_heads, page_size, head_dim]
        self.data = torch.zeros(
            shape.num_pages, shape.num_layers, 2, shape.num_kv_heads, shape.page_size, shape.head_dim,
            dtype=shape.dtype, device=device,
        )

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each [num_pages, num_kv_heads, page_size, head_dim]."""
        return self.data[:, layer, 0], self.data[:, layer, 1]

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
