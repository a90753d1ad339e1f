"""The layout contract: everything a prefill rank and a decode rank must agree on.

Both sides describe their KV pool with plain numbers (`KVLayout`; transfer never imports the
worker). The contract adds the model identity and the backend and is exchanged at bootstrap:
a mismatch is refused with an error that names every differing field, so a wrong pairing is
loud at registration time instead of garbage tokens later.

Heterogeneous TP is allowed: prefill and decode may differ in `tp_size` (and so in heads per
rank); "compatible" means model, layers, page size, head dim, dtype, total kv heads, cache
groups and backend agree. The hash is sha256 over a canonical JSON encoding (stable across
processes and Python versions, unlike `hash()`).
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import asdict, dataclass, field

# Bytes per element of the dtype names the engine uses (torch names without the "torch." prefix).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}


# The byte order of V inside a page's head block when it is not [page_size, head_dim]: FP8 pages
# keep V token-major, [head_dim, page_size] (worker/kv_cache.py), the order the attention
# kernels' P·V dot reads it in. A peer that keeps another order (an older build) is refused.
V_TOKEN_MAJOR = "token_major"


def v_layout(dtype: str) -> str:
    """The V byte order of K/V pages of this dtype (a name as in DTYPE_BYTES): V_TOKEN_MAJOR
    for FP8 pages, "" for the feature-major [page_size, head_dim] of every other dtype."""
    return V_TOKEN_MAJOR if dtype == "float8_e4m3fn" else ""


class ContractError(ValueError):
    """A layout description is invalid or two contracts cannot exchange KV; names the fields."""


def ring_pages(window: int, page_size: int) -> int:
    """Pages of a sliding-window ring: ceil(window / page_size) + 1. The one formula for it.

    Token p sits in ring page (p // page_size) % ring_pages. The extra page is what keeps the
    last `window` tokens whole while the newest page fills: the page recycled when token p
    starts a new page last held tokens at least (ring_pages - 1) * page_size >= window back.
    Both sides derive it from (window, page_size), which the contract fixes, so a ring page
    index means the same token range on prefill and decode.
    """
    return -(-window // page_size) + 1


class CacheKind(str, enum.Enum):
    """How a cache group keeps its state, which decides what transfer ships for it."""

    FULL_ATTENTION = "full_attention"  # one page per page_size tokens, all retained: ship pages
    SLIDING_WINDOW = "sliding_window"  # a ring of the last `window` tokens: ship the replay tail
    RECURRENT = "recurrent"  # a fixed-size state per request (mamba/linear attn): ship the state
    # MLA (DeepSeek): one latent row per token per layer, no heads and no K/V pair, the same on
    # every TP rank; all retained, so ship pages, one copy to each decode rank.
    MLA_LATENT = "mla_latent"


@dataclass(frozen=True)
class CacheGroup:
    """A set of layers that share one cache kind (e.g. the window layers of a hybrid model)."""

    kind: CacheKind
    layers: tuple[int, ...]  # layer indices of this group, ascending
    window: int = 0  # tokens kept, for SLIDING_WINDOW; 0 otherwise
    latent_dim: int = 0  # MLA_LATENT: elements per token per layer (kv_lora_rank + rope dim)
    state_bytes: int = 0  # RECURRENT: bytes of one request's state slot (all the group's layers)

    def __post_init__(self) -> None:
        if (self.kind is CacheKind.RECURRENT) != (self.state_bytes > 0):
            raise ContractError(f"CacheGroup.state_bytes must be > 0 for a recurrent group and 0 "
                                f"for any other kind, got {self.state_bytes} for {self.kind.value}")
        if self.kind is CacheKind.SLIDING_WINDOW and self.window <= 0:
            raise ContractError(f"CacheGroup.window must be > 0 for a sliding_window group, "
                                f"got {self.window}")
        if (self.kind is CacheKind.MLA_LATENT) != (self.latent_dim > 0):
            raise ContractError(f"CacheGroup.latent_dim must be > 0 for an mla_latent group and 0 "
                                f"for any other kind, got {self.latent_dim} for {self.kind.value}")

    def ring_pages(self, page_size: int) -> int:
        """Pages of a SLIDING_WINDOW group's per-request ring (`ring_pages`)."""
        return ring_pages(self.window, page_size)


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """Global kv-head ids held by `tp_rank`.

    tp_size <= total_heads: an even split, rank r holds a contiguous block. tp_size > total_heads
    (GQA with more ranks than kv heads): each rank holds a replica of one head, ranks
    [h*rep, (h+1)*rep) all hold head h.
    """
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ContractError(f"num_kv_heads_total={total_heads} must be divisible by "
                                f"tp_size={tp_size}")
        per = total_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % total_heads:
        raise ContractError(f"tp_size={tp_size} must be a multiple of "
                            f"num_kv_heads_total={total_heads} when larger")
    return [tp_rank // (tp_size // total_heads)]


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV pool:
    `data[num_pages, num_layers, 2, num_kv_heads_local, page_size, head_dim]`.

    Built by the worker from plain numbers; the transfer layer computes byte offsets from it.

    MLA latent pages (one MLA_LATENT group over every layer): `data[num_pages, num_layers,
    page_size, latent_dim]`, described as one plane (no K/V pair) of one kv "head" of width
    `head_dim = latent_dim` that every TP rank holds whole (`num_kv_heads_total = 1`, replicated),
    so page bytes, offsets and the head-slice plan follow from the same formulas.
    """

    num_pages: int
    num_layers: int
    page_size: int  # tokens per page
    head_dim: int
    dtype: str  # "bfloat16", "float32", ...
    num_kv_heads_total: int  # kv heads of the model
    tp_rank: int = 0
    tp_size: int = 1
    groups: tuple[CacheGroup, ...] = ()  # () = every layer is full attention
    # Pages of the window region (SLIDING_WINDOW group) that follows the full region in the same
    # registered memory:
    # `window[num_window_pages, num_window_layers, 2, heads, page_size, head_dim]` at byte
    # `window_base`. 0 = no window region (window layers, if any, live in full pages).
    num_window_pages: int = 0
    # FP8 pages: a label of the K/V scales that dequantize them ("1.0", or the checkpoint's
    # scales' digest); "" for pages that are not FP8. Both sides must agree (COMPATIBLE_FIELDS).
    kv_scales: str = ""
    # Speculative decoding's drafter whose KV rides in the pages as extra layers (the last
    # ones of num_layers), e.g. "eagle:1:<fingerprint>"; "" = none. Both sides must agree: a
    # decode drafter reads the KV and hidden state prefill's drafter computed.
    speculative: str = ""
    # The state region (RECURRENT group): `state[num_state_slots, state_bytes]` at byte
    # `state_base` of the registered memory (the worker aligns it; 0 slots = no region). A
    # request's state is one slot: one contiguous range of the group's `state_bytes`.
    num_state_slots: int = 0
    state_base: int = 0

    def state_offset(self, slot: int) -> int:
        """Byte offset of state slot `slot` from the pool's base pointer."""
        group = self.state_group
        if group is None or not 0 <= slot < self.num_state_slots:
            raise ContractError(f"KVLayout: state slot {slot} is outside this layout's state "
                                f"region of {self.num_state_slots} slots")
        return self.state_base + slot * group.state_bytes

    def __post_init__(self) -> None:
        if self.num_state_slots and self.state_group is None:
            raise ContractError("KVLayout.num_state_slots needs a recurrent group in groups")
        for name in ("num_pages", "num_layers", "page_size", "head_dim", "num_kv_heads_total",
                     "tp_size"):
            if getattr(self, name) <= 0:
                raise ContractError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")
        windows = [g for g in self.groups if g.kind is CacheKind.SLIDING_WINDOW]
        if self.num_window_pages < 0:
            raise ContractError(f"KVLayout.num_window_pages must be >= 0, "
                                f"got {self.num_window_pages}")
        if self.num_window_pages and len(windows) != 1:
            raise ContractError(f"KVLayout.num_window_pages={self.num_window_pages} needs exactly "
                                f"one sliding_window group in KVLayout.groups, got {len(windows)} "
                                "(merge window layers into one group)")
        if self.num_window_pages and len(windows[0].layers) >= self.num_layers:
            raise ContractError("KVLayout.groups: a window region needs at least one "
                                "full_attention layer; keep all-window models in full pages "
                                "(num_window_pages=0)")
        if self.dtype not in DTYPE_BYTES:
            raise ContractError(f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, "
                                f"got {self.dtype!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ContractError(f"KVLayout.tp_rank must be in [0, {self.tp_size}), "
                                f"got {self.tp_rank}")
        heads_of_rank(self.num_kv_heads_total, self.tp_size, self.tp_rank)  # divisibility check
        self._check_latent()

    def _check_latent(self) -> None:
        """An MLA_LATENT group is the whole pool: every layer, one replicated latent 'head'."""
        latent = [g for g in self.groups if g.kind is CacheKind.MLA_LATENT]
        if not latent:
            return
        group = latent[0]
        if len(self.groups) != 1 or group.layers != tuple(range(self.num_layers)):
            raise ContractError("KVLayout.groups: an mla_latent group must be the only group and "
                                f"list every layer 0..{self.num_layers - 1} (one latent per layer)")
        if self.head_dim != group.latent_dim or self.num_kv_heads_total != 1:
            raise ContractError(f"KVLayout: an mla_latent pool has head_dim = latent_dim "
                                f"({group.latent_dim}) and num_kv_heads_total = 1, got head_dim "
                                f"{self.head_dim} and num_kv_heads_total {self.num_kv_heads_total}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def heads(self) -> list[int]:
        """Global kv-head ids on this rank, in the order they sit in a page."""
        return heads_of_rank(self.num_kv_heads_total, self.tp_size, self.tp_rank)

    @property
    def num_kv_heads_local(self) -> int:
        return len(self.heads)

    @property
    def head_bytes(self) -> int:
        """One head's K (or V) of one layer in one page: page_size * head_dim elements."""
        return self.page_size * self.head_dim * self.itemsize

    @property
    def latent_group(self) -> CacheGroup | None:
        """The MLA_LATENT group (None for K/V pools)."""
        return next((g for g in self.groups if g.kind is CacheKind.MLA_LATENT), None)

    @property
    def planes(self) -> int:
        """Rows per (layer, head) in a page: K and V (2), or the one MLA latent (1)."""
        return 1 if self.latent_group is not None else 2

    @property
    def window_group(self) -> CacheGroup | None:
        """The SLIDING_WINDOW group kept in its own region (None without a window region)."""
        if not self.num_window_pages:
            return None
        return next(g for g in self.groups if g.kind is CacheKind.SLIDING_WINDOW)

    @property
    def num_full_layers(self) -> int:
        """Layers stored in the full pages: all of them but those a window region or the state
        region holds."""
        group = self.window_group
        state = self.state_group
        return (self.num_layers - (len(group.layers) if group is not None else 0)
                - (len(state.layers) if state is not None else 0))

    @property
    def state_group(self) -> CacheGroup | None:
        """The RECURRENT group (its layers keep a state slot per request, no pages)."""
        return next((g for g in self.groups if g.kind is CacheKind.RECURRENT), None)

    @property
    def page_bytes(self) -> int:
        """One full page: every full-region layer's K and V (or its MLA latent)."""
        return self.num_full_layers * self.planes * self.num_kv_heads_local * self.head_bytes

    @property
    def window_base(self) -> int:
        """Byte offset of the window region from the pool's base (it follows the full pages)."""
        return self.num_pages * self.page_bytes

    def window_view(self) -> KVLayout:
        """The window region as a plain layout of its own (offsets from `window_base`)."""
        group = self.window_group
        if group is None:
            raise ContractError("KVLayout.window_view: this layout has no window region "
                                "(num_window_pages=0)")
        return KVLayout(
            num_pages=self.num_window_pages, num_layers=len(group.layers), page_size=self.page_size,
            head_dim=self.head_dim, dtype=self.dtype, num_kv_heads_total=self.num_kv_heads_total,
            tp_rank=self.tp_rank, tp_size=self.tp_size,
        )

    @property
    def pool_bytes(self) -> int:
        window = self.window_view().pool_bytes if self.num_window_pages else 0
        pages = self.num_pages * self.page_bytes + window
        group = self.state_group
        if group is None or not self.num_state_slots:
            return pages
        return self.state_base + self.num_state_slots * group.state_bytes

    def offset(self, page: int, layer: int = 0, kv: int = 0, local_head: int = 0) -> int:
        """Byte offset of (page, layer, K|V, head) from the pool's base pointer."""
        row = (layer * self.planes + kv) * self.num_kv_heads_local + local_head
        return page * self.page_bytes + row * self.head_bytes


def _canonical_group(g: CacheGroup) -> dict[str, object]:
    """A group's canonical fields; latent_dim only where set, so the hashes of contracts without
    an MLA group stay what they were before MLA existed."""
    d: dict[str, object] = {"kind": g.kind.value, "layers": list(g.layers), "window": g.window}
    if g.latent_dim:
        d["latent_dim"] = g.latent_dim
    if g.state_bytes:
        d["state_bytes"] = g.state_bytes
    return d


# Fields that must be equal between prefill and decode (tp_rank/tp_size/heads per rank may differ).
COMPATIBLE_FIELDS = (
    "model_name", "model_fingerprint", "num_layers", "page_size", "head_dim", "dtype",
    "num_kv_heads_total", "groups", "backend", "kv_scales", "speculative", "v_layout",
)


@dataclass(frozen=True)
class LayoutContract:
    """What a rank promises its peer about its KV memory; exchanged (and hashed) at bootstrap."""

    model_name: str
    model_fingerprint: str  # given by the caller (e.g. a hash of config.json + weight names)
    num_layers: int
    page_size: int
    num_kv_heads_total: int
    num_kv_heads_local: int
    head_dim: int
    dtype: str
    tp_rank: int
    tp_size: int
    backend: str
    groups: tuple[CacheGroup, ...] = field(default=())
    # KVLayout.kv_scales; left out of the canonical form when "" (old hashes hold)
    kv_scales: str = ""
    # KVLayout.speculative; left out of the canonical form when "" (old hashes hold)
    speculative: str = ""
    # v_layout(dtype) for K/V pages ("" for MLA latent pages: no V); left out when ""
    v_layout: str = ""

    @classmethod
    def from_layout(cls, layout: KVLayout, *, model_name: str, model_fingerprint: str,
                    backend: str) -> LayoutContract:
        groups = layout.groups or (
            CacheGroup(CacheKind.FULL_ATTENTION, tuple(range(layout.num_layers))),)
        return cls(
            model_name=model_name, model_fingerprint=model_fingerprint,
            num_layers=layout.num_layers, page_size=layout.page_size,
            num_kv_heads_total=layout.num_kv_heads_total,
            num_kv_heads_local=layout.num_kv_heads_local, head_dim=layout.head_dim,
            dtype=layout.dtype, tp_rank=layout.tp_rank, tp_size=layout.tp_size, backend=backend,
            groups=groups, kv_scales=layout.kv_scales, speculative=layout.speculative,
            v_layout="" if any(g.kind == CacheKind.MLA_LATENT for g in groups)
            else v_layout(layout.dtype),
        )

    def layout(self, num_pages: int = 1, num_window_pages: int = 0, num_state_slots: int = 0,
               state_base: int = 0) -> KVLayout:
        """The peer's layout (for offset arithmetic); region sizes are not in the contract."""
        return KVLayout(
            num_pages=num_pages, num_layers=self.num_layers, page_size=self.page_size,
            head_dim=self.head_dim, dtype=self.dtype, num_kv_heads_total=self.num_kv_heads_total,
            tp_rank=self.tp_rank, tp_size=self.tp_size, groups=self.groups,
            num_window_pages=num_window_pages, kv_scales=self.kv_scales,
            num_state_slots=num_state_slots, state_base=state_base, speculative=self.speculative,
        )

    def canonical(self) -> str:
        """Canonical JSON: sorted keys, enums as values, tuples as lists."""
        d = asdict(self)
        d["groups"] = [_canonical_group(g) for g in self.groups]
        if not self.kv_scales:
            del d["kv_scales"]  # pages that are not FP8 hash as they did before the field existed
        if not self.speculative:
            del d["speculative"]  # likewise without a drafter
        if not self.v_layout:
            del d["v_layout"]  # likewise feature-major V
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def compat_hash(self) -> str:
        """Hash over the fields both sides must share (equal across TP ranks and TP sizes)."""
        d = json.loads(self.canonical())
        return hashlib.sha256(json.dumps({k: d[k] for k in COMPATIBLE_FIELDS if k in d},
                                         sort_keys=True).encode()).hexdigest()

    def mismatches(self, other: LayoutContract) -> list[str]:
        """`field: ours != theirs` for every field that must match and does not."""
        return [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in COMPATIBLE_FIELDS if getattr(self, name) != getattr(other, name)
        ]

    def check_compatible(self, other: LayoutContract) -> None:
        """Raise ContractError naming every differing field (ours first, the peer's second)."""
        diffs = self.mismatches(other)
        if diffs:
            raise ContractError(
                "KV layout contracts differ: " + "; ".join(diffs)
                + " (prefill and decode must serve the same model with the same kv dtype, page "
                "size, groups and speculative section)"
            )
