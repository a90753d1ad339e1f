"""The KV cache memory of one worker rank: full pages, and a window region for hybrid models.

Full region: `data[num_pages, num_full_layers, 2, num_kv_heads, page_size, head_dim]`.

Why page-major: a page holds every full layer's K and V for `page_size` tokens in one
contiguous run of bytes, so shipping a prompt to a decode worker is one transfer range per run
of consecutive pages, whatever the layer count. Heads are outer to tokens inside a page so that
a head slice of one (layer, K|V) is contiguous too — heterogeneous TP moves head slices.

FP8 pages (float8_e4m3fn) keep V token-major inside a head's block: [head_dim, page_size] in
memory, presented by `layer()` as the same [pages, heads, page_size, head_dim] view (strides
(.., 1, page_size)), so torch code indexes it as before and a page is the same bytes. The
Triton decode and prefill kernels then feed the P·V dot from 16-token runs of one feature,
the layout its float16 operand wants, without the round trip through shared memory that
converting feature-major e4m3 rows costs (1.2-1.45x on the H200, docs/benchmarks.md).

Window region (models with sliding-window layers and at least one full layer, see
docs/hybrid-cache.md): `window[num_window_pages, num_window_layers, 2, heads, page_size,
head_dim]`, the same page shape over the window layers only. A request holds a ring of
`ring_pages` of them (token p in ring page (p // page_size) % ring_pages), so a window layer
keeps only its last W tokens instead of the whole context.

State region (models with recurrent layers, e.g. Qwen3-Next's Gated DeltaNet; see
docs/recurrent-state.md): a layer that keeps a fixed-size state per request instead of K/V
has no rows in the page regions. Its state lives in `num_state_slots` slots, slot-major:

    state[num_state_slots, state_slot_bytes]  (bytes)
    one slot = for each state layer, in order: conv [conv shape] | ssm [ssm shape]

so a request's whole state (every layer, conv and ssm) is one contiguous byte range, and a
snapshot or a transfer of a slot is one copy. Conv and ssm may differ in dtype (the ssm state
is float32 whatever the model dtype); each piece starts on a `STATE_ALIGN`-byte boundary.

All regions are views of one byte allocation (full, window, then state), so the transfer
backend registers one block of memory once at start-up; the window region starts at byte
`num_pages * page_bytes`, the state region at `KVShape.state_base`.

MLA latent pages (DeepSeek, `latent_dim > 0`): `data[num_pages, num_layers, page_size,
latent_dim]`: per token per layer one latent row (the compressed kv of kv_lora_rank elements,
then the shared rope key), no heads and no K/V pair, the same on every TP rank. Still
page-major, so a run of pages is one transfer range; read it through `latent(layer)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transfer.contract import V_TOKEN_MAJOR, CacheGroup, CacheKind, KVLayout, ring_pages, v_layout
from worker.config import ConfigError

STATE_ALIGN = 64  # bytes: every state piece (and the state region) starts on this boundary


def _align(n: int) -> int:
    return -(-n // STATE_ALIGN) * STATE_ALIGN


@dataclass(frozen=True)
class StateShape:
    """One state slot of one recurrent layer on one rank (the model says it: `state_shape()`)."""

    conv: tuple[int, ...]  # e.g. Gated DeltaNet: [conv_kernel - 1, conv_dim_local], last inputs
    ssm: tuple[int, ...]  # e.g. Gated DeltaNet: [num_v_heads_local, head_k_dim, head_v_dim]
    conv_dtype: torch.dtype  # the model dtype (the conv's inputs, stored as they came)
    ssm_dtype: torch.dtype = torch.float32  # the recurrent state accumulates: float32

    @property
    def conv_bytes(self) -> int:
        return _numel(self.conv) * self.conv_dtype.itemsize

    @property
    def ssm_bytes(self) -> int:
        return _numel(self.ssm) * self.ssm_dtype.itemsize

    @property
    def layer_bytes(self) -> int:
        """One layer's piece of a slot: conv then ssm, each padded to STATE_ALIGN."""
        return _align(self.conv_bytes) + _align(self.ssm_bytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    # MLA: elements of the one latent row per token per layer (kv_lora_rank + qk_rope_head_dim);
    # then num_kv_heads is 1 and head_dim is latent_dim. 0 = K/V heads.
    latent_dim: int = 0
    # Recurrent layers (no K/V rows; a state slot per request in the state region), ascending.
    state_layers: tuple[int, ...] = ()
    state: StateShape | None = None  # one slot of one state layer; needed when state_layers
    num_state_slots: int = 0  # slots of the state region (one per live request, plus snapshots)
    # Speculative decoding's model drafter (worker/spec/): its layers are the last
    # `draft_layers` of num_layers, kept in the full pages like any full layer (same page ids:
    # the page table, the prefix cache and PD carry them); `speculative` labels the drafter
    # for the layout contract ("eagle:1:<fingerprint>"), "" without one.
    draft_layers: int = 0
    speculative: str = ""

    def __post_init__(self) -> None:
        if self.state_layers and self.state is None:
            raise ValueError("KVShape.state_layers needs KVShape.state (the model's state_shape())")
        if set(self.state_layers) & set(self.window_layers):
            raise ValueError("KVShape: a layer cannot be both in window_layers and state_layers")
        if self.latent_dim and (self.num_kv_heads, self.head_dim, self.window_layers) != (
                1, self.latent_dim, ()):
            raise ValueError(f"KVShape: an MLA latent cache has num_kv_heads 1, head_dim = "
                             f"latent_dim ({self.latent_dim}) and no window layers; got {self}")

    @property
    def planes(self) -> int:
        """Rows per layer per token: K and V (2), or the one MLA latent (1)."""
        return 1 if self.latent_dim else 2

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - len(self.window_layers) - len(self.state_layers)

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
    def state_slot_bytes(self) -> int:
        """Bytes of one state slot: every state layer's conv and ssm pieces."""
        return len(self.state_layers) * self.state.layer_bytes if self.state is not None else 0

    @property
    def state_base(self) -> int:
        """Byte offset of the state region in the allocation (after the page regions, aligned)."""
        pages = self.num_pages * self.page_bytes + self.num_window_pages * self.window_page_bytes
        return _align(pages) if self.state_layers else pages

    @property
    def _layer_page_bytes(self) -> int:
        rows = self.planes * self.num_kv_heads * self.page_size  # K|V (or the latent) per head
        return rows * self.head_dim * self.dtype.itemsize


class KVCache:
    """Owns the paged KV memory; hands out per-layer views for attention."""

    def __init__(self, shape: KVShape, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        h, s, d = shape.num_kv_heads, shape.page_size, shape.head_dim
        full = shape.num_pages * shape.page_bytes
        window = shape.num_window_pages * shape.window_page_bytes
        state = shape.num_state_slots * shape.state_slot_bytes
        # One byte allocation, viewed per region in its dtype (the state mixes dtypes).
        size = shape.state_base + state
        try:
            self._buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # the CPU allocator's is bare
            raise ConfigError(
                f"cache: the KV cache's {size / 2**30:.1f} GiB ({shape.num_pages} pages) do not "
                f"fit on {device} ({str(exc).splitlines()[0][:120]}); lower cache.num_pages or "
                "cache.max_total_tokens") from None
        if shape.latent_dim:
            # data: [num_pages, num_layers, page_size, latent_dim]
            self.data = self._buffer[:full].view(shape.dtype).view(
                shape.num_pages, shape.num_layers, s, d)
        else:
            # data: [num_pages, num_full_layers, 2, num_kv_heads, page_size, head_dim]
            self.data = self._buffer[:full].view(shape.dtype).view(
                shape.num_pages, shape.num_full_layers, 2, h, s, d)
        # window: [num_window_pages, num_window_layers, 2, num_kv_heads, page_size, head_dim]
        self.window = self._buffer[full : full + window].view(shape.dtype).view(
            shape.num_window_pages, len(shape.window_layers), 2, h, s, d)
        # state_region: [num_state_slots, state_slot_bytes] (bytes; see the module doc)
        self.state_region = self._buffer[shape.state_base :].view(
            shape.num_state_slots, shape.state_slot_bytes)
        windowed, stateful = set(shape.window_layers), set(shape.state_layers)
        # layer -> (in the window region?, index inside its region); state layers: (False, -1)
        self._slot: list[tuple[bool, int]] = []
        self._state_index: dict[int, int] = {layer: i for i, layer in enumerate(shape.state_layers)}
        counts = [0, 0]
        for layer in range(shape.num_layers):
            if layer in stateful:
                self._slot.append((False, -1))
                continue
            w = layer in windowed
            self._slot.append((w, counts[w]))
            counts[w] += 1

    def is_window(self, layer: int) -> bool:
        """Whether `layer` keeps its KV in the window region (a ring per request)."""
        return self._slot[layer][0]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of one layer: each
        [pages of its region, num_kv_heads, page_size, head_dim] (FP8 V: token-major strides)."""
        if self.shape.latent_dim:
            raise TypeError("an MLA latent cache has no K/V views; read it through latent(layer)")
        w, i = self._slot[layer]
        if i < 0:
            raise ValueError(
                f"layer {layer} is a recurrent layer: it has a state slot (KVCache.state), no K/V")
        region = self.window if w else self.data
        k, v = region[:, i, 0], region[:, i, 1]
        if v_layout(dtype_name(self.shape.dtype)) == V_TOKEN_MAJOR:  # module doc
            v = v.as_strided(v.shape, (v.stride(0), v.stride(1), 1, v.shape[2]))
        return k, v

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv and ssm views of one recurrent layer, indexed by state slot:
        conv [num_state_slots, *StateShape.conv], ssm [num_state_slots, *StateShape.ssm]
        (strided: consecutive slots are `state_slot_bytes` apart)."""
        index = self._state_index.get(layer)
        if index is None or self.shape.state is None:
            raise ValueError(
                f"layer {layer} has no state slot: KVShape.state_layers={self.shape.state_layers}; "
                "a recurrent model needs the engine to size the state region "
                "(KVShape.state_layers, state, num_state_slots)")
        st = self.shape.state
        base = index * st.layer_bytes
        conv = self.state_region[:, base : base + st.conv_bytes]
        ssm_base = base + _align(st.conv_bytes)
        ssm = self.state_region[:, ssm_base : ssm_base + st.ssm_bytes]
        n = self.shape.num_state_slots
        return conv.view(st.conv_dtype).view(n, *st.conv), ssm.view(st.ssm_dtype).view(n, *st.ssm)

    def zero_state(self, slots: torch.Tensor) -> None:
        """Reset slots [n] (int64) to the state before any token: every layer's conv and ssm."""
        self.state_region[slots] = 0

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole slots src [n] → dst [n] (a prefix-cache snapshot or its restore)."""
        self.state_region[dst] = self.state_region[src]

    def apply_state_copies(self, copies: list[tuple[int, int]]) -> None:
        """The plan's slot initialisations, in order: (src slot, dst slot), src -1 = zeros
        (SchedulePlan.state_copies); run before the forward that reads the destinations."""
        for src, dst in copies:
            if src < 0:
                self.state_region[dst] = 0
            else:
                self.state_region[dst] = self.state_region[src]

    def latent(self, layer: int) -> torch.Tensor:
        """MLA: one layer's latent rows [num_pages, page_size, latent_dim] (a strided view)."""
        if not self.shape.latent_dim:
            raise TypeError("latent(layer) is for MLA latent caches (KVShape.latent_dim > 0)")
        return self.data[:, layer]

    def data_ptr(self) -> int:
        return self._buffer.data_ptr()

    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


def cache_groups(shape: KVShape) -> tuple[CacheGroup, ...]:
    """The layout contract's cache groups: () when every layer lives in full pages (as before
    window rings existed, so such contracts hash as they always did)."""
    if shape.latent_dim:
        return (CacheGroup(CacheKind.MLA_LATENT, tuple(range(shape.num_layers)),
                           latent_dim=shape.latent_dim),)
    if not shape.window_layers and not shape.state_layers:
        return ()
    paged = set(shape.window_layers) | set(shape.state_layers)
    groups = [CacheGroup(CacheKind.FULL_ATTENTION,
                         tuple(i for i in range(shape.num_layers) if i not in paged))]
    if shape.window_layers:
        groups.append(CacheGroup(CacheKind.SLIDING_WINDOW, shape.window_layers, shape.window))
    if shape.state_layers:
        groups.append(CacheGroup(CacheKind.RECURRENT, shape.state_layers,
                                 state_bytes=shape.state_slot_bytes))
    return tuple(groups)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the transfer layer names it (transfer/contract.py DTYPE_BYTES)."""
    return str(dtype).removeprefix("torch.")


def transfer_layout(shape: KVShape, num_kv_heads_total: int, tp_rank: int,
                    tp_size: int) -> KVLayout:
    """The rank's KV memory described to the transfer layer (plain numbers: transfer never
    imports the worker). Every rank of a worker builds it the same way."""
    return KVLayout(
        num_pages=shape.num_pages, num_layers=shape.num_layers, page_size=shape.page_size,
        head_dim=shape.head_dim, dtype=dtype_name(shape.dtype),
        num_kv_heads_total=num_kv_heads_total, tp_rank=tp_rank, tp_size=tp_size,
        groups=cache_groups(shape), num_window_pages=shape.num_window_pages,
        num_state_slots=shape.num_state_slots, state_base=shape.state_base,
        kv_scales=shape.kv_scales, speculative=shape.speculative,
    )
