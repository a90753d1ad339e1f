"""The KV cache memory of one worker rank: full pages, and a window region for hybrid models.

Full region: `data[num_pages, num_full_layers, 2, num_kv_heads, page_size, head_dim]`.

Why page-major: a page holds every full layer's K and V for `page_size` tokens in one
contiguous run of bytes, so shipping a prompt to a decode worker is one transfer range per run
of consecutive pages, whatever the layer count. Heads are outer to tokens inside a page so that
a head slice of one (layer, K|V) is contiguous too — heterogeneous TP moves head slices.

Window region (models with sliding-window layers and at least one full layer, see
docs/hybrid-cache.md): `window[num_window_pages, num_window_layers, 2, heads, page_size,
head_dim]`, the same page shape over the window layers only. A request holds a ring of
`ring_pages` of them (token p in ring page (p // page_size) % ring_pages), so a window layer
keeps only its last W tokens instead of the whole context.

Both regions are views of one allocation, full first, so the transfer backend registers one
block of memory once at start-up; the window region starts at byte `num_pages * page_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.contract import CacheGroup, CacheKind, KVLayout, ring_pages


@dataclass(frozen=True)
class KVShape:
    num_pages: int
    num_layers: int  # all layers of the model (full + window)
    num_kv_heads: int  # on this rank
    page_size: int
    head_dim: int
    dtype: torch.dtype  # the KV storage dtype: the model's, or float8_e4m3fn (cache.kv_cache_dtype)
    window_layers: tuple[int, ...] = ()  # layers kept in the window region (ascending); () = none
    window: int = 0  # tokens a window layer attends to (its sliding window)
    num_window_pages: int = 0  # pages of the window region (rings of all live requests)
    # FP8 pages: which K/V scales dequantize them (worker/model/fp8.py KVScales.label, e.g. "1.0");
    # "" when the pages are not FP8. Part of the layout contract: both sides must use the same.
    kv_scales: str = ""

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - len(self.window_layers)

    @property
    def ring_pages(self) -> int:
        """Window pages per request (transfer.contract.ring_pages); 0 without window layers."""
        return ring_pages(self.window, self.page_size) if self.window_layers else 0

    @property
    def page_bytes(self) -> int:
        """Bytes of one full page across the full layers, K and V."""
        return self.num_full_layers * self._layer_page_bytes

    @property
    def window_page_bytes(self) -> int:
        return len(self.window_layers) * self._layer_page_bytes

    @property
    def _layer_page_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.dtype.itemsize


class KVCache:
    """Owns the paged KV memory; hands out per-layer views for attention."""

    def __init__(self, shape: KVShape, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        h, s, d = shape.num_kv_heads, shape.page_size, shape.head_dim
        full = shape.num_pages * shape.num_full_layers * 2 * h * s * d
        window = shape.num_window_pages * len(shape.window_layers) * 2 * h * s * d
        self._buffer = torch.zeros(full + window, dtype=shape.dtype, device=device)
        # data: [num_pages, num_full_layers, 2, num_kv_heads, page_size, head_dim]
        self.data = self._buffer[:full].view(shape.num_pages, shape.num_full_layers, 2, h, s, d)
        # window: [num_window_pages, num_window_layers, 2, num_kv_heads, page_size, head_dim]
        self.window = self._buffer[full:].view(shape.num_window_pages, len(shape.window_layers), 2, h, s, d)
        windowed = set(shape.window_layers)
        # layer -> (in the window region?, index inside its region)
        self._slot: list[tuple[bool, int]] = []
        counts = [0, 0]
        for layer in range(shape.num_layers):
            w = layer in windowed
            self._slot.append((w, counts[w]))
            counts[w] += 1

    def is_window(self, layer: int) -> bool:
        """Whether `layer` keeps its KV in the window region (a ring per request)."""
        return self._slot[layer][0]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each [pages of its region, num_kv_heads, page_size, head_dim]."""
        w, i = self._slot[layer]
        region = self.window if w else self.data
        return region[:, i, 0], region[:, i, 1]

    def data_ptr(self) -> int:
        return self._buffer.data_ptr()

    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


def cache_groups(shape: KVShape) -> tuple[CacheGroup, ...]:
    """The layout contract's cache groups: () when every layer lives in full pages (as before
    window rings existed, so such contracts hash as they always did)."""
    if not shape.window_layers:
        return ()
    full = tuple(i for i in range(shape.num_layers) if i not in shape.window_layers)
    return (CacheGroup(CacheKind.FULL_ATTENTION, full),
            CacheGroup(CacheKind.SLIDING_WINDOW, shape.window_layers, shape.window))


def transfer_layout(shape: KVShape, num_kv_heads_total: int, tp_rank: int, tp_size: int) -> KVLayout:
    """The rank's KV memory described to the transfer layer (plain numbers: transfer never
    imports the worker). Every rank of a worker builds it the same way."""
    return KVLayout(
        num_pages=shape.num_pages, num_layers=shape.num_layers, page_size=shape.page_size,
        head_dim=shape.head_dim, dtype=str(shape.dtype).removeprefix("torch."),
        num_kv_heads_total=num_kv_heads_total, tp_rank=tp_rank, tp_size=tp_size,
        groups=cache_groups(shape), num_window_pages=shape.num_window_pages,
            kv_scales=shape.kv_scales,
    )
