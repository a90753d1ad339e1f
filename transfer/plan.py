"""The transfer plan: which bytes of a prefill rank's pool go where in a decode rank's pool.

Pure functions over `KVLayout`s and page ids; no I/O. Output is a list of `Range`s, byte
offsets from each side's registered base pointer, coalesced so that runs of consecutive
pages (or of consecutive head slices) travel as one write.

Heterogeneous TP: a page holds, per (layer, K|V), the rank's heads as contiguous blocks of
`page_size*head_dim` elements. A source rank sends to a destination rank exactly the heads
both hold; with TP > total kv heads a head is replicated on several ranks and only its first
replica (the lowest source rank holding it) sends, so every destination byte is written once.

MLA latent pages (an MLA_LATENT group): every rank holds the same latent, so a destination rank
needs exactly one copy of each page, and gets it from source rank `dst.tp_rank % src.tp_size`
(TP2 -> TP1: rank 0 sends, rank 1 sends nothing; TP1 -> TP2: rank 0 sends to both; TP2 -> TP2:
each source rank feeds its own counterpart, so the copies are spread over the source ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.contract import CacheGroup, CacheKind, KVLayout


class PlanError(ValueError):
    """The page lists given to the planner are inconsistent; the message names the argument."""


@dataclass(frozen=True)
class Range:
    """One contiguous write: `length` bytes from src base + `src` to dst base + `dst`."""

    src: int
    dst: int
    length: int


def _first_replica(layout: KVLayout, head: int) -> int:
    """Lowest rank of `layout`'s TP group that holds `head`."""
    if layout.tp_size <= layout.num_kv_heads_total:
        return head // (layout.num_kv_heads_total // layout.tp_size)
    return head * (layout.tp_size // layout.num_kv_heads_total)


def head_runs(src: KVLayout, dst: KVLayout) -> list[tuple[int, int, int]]:
    """Heads `src` sends to `dst` as runs (src_local_head, dst_local_head, num_heads)."""
    if src.num_kv_heads_total != dst.num_kv_heads_total:
        raise PlanError(
            f"num_kv_heads_total differs: src {src.num_kv_heads_total} vs dst "
            f"{dst.num_kv_heads_total}"
        )
    if (src.latent_group is None) != (dst.latent_group is None):
        raise PlanError("one side keeps MLA latent pages, the other K/V pages; check the contract")
    if src.latent_group is not None:  # replicated latent: one source rank per destination rank
        return [(0, 0, 1)] if dst.tp_rank % src.tp_size == src.tp_rank else []
    dst_pos = {h: i for i, h in enumerate(dst.heads)}
    runs: list[tuple[int, int, int]] = []
    for s_i, h in enumerate(src.heads):
        if h not in dst_pos or _first_replica(src, h) != src.tp_rank:
            continue
        d_i = dst_pos[h]
        if runs and runs[-1][0] + runs[-1][2] == s_i and runs[-1][1] + runs[-1][2] == d_i:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s_i, d_i, 1))
    return runs


def coalesce(ranges: list[Range]) -> list[Range]:
    """Merge neighbours that continue each other on both sides (order kept)."""
    out: list[Range] = []
    for r in ranges:
        if out and out[-1].src + out[-1].length == r.src and out[-1].dst + out[-1].length == r.dst:
            out[-1] = Range(out[-1].src, out[-1].dst, out[-1].length + r.length)
        else:
            out.append(r)
    return out


def split_ranges(ranges: list[Range], max_bytes: int) -> list[Range]:
    """Cut ranges longer than `max_bytes` (see TransferBackend.max_range_bytes for why)."""
    out: list[Range] = []
    for r in ranges:
        for off in range(0, r.length, max_bytes):
            out.append(Range(r.src + off, r.dst + off, min(max_bytes, r.length - off)))
    return out


def page_positions(
    num_src_pages: int, start_page: int, skip_pages: int, num_dst_pages: int
) -> range:
    """Request page positions that one `send` covers and decode lacks."""
    if start_page < 0 or skip_pages < 0:
        raise PlanError(f"start_page ({start_page}) and skip_pages ({skip_pages}) must be >= 0")
    end = start_page + num_src_pages
    if end > num_dst_pages:
        raise PlanError(
            f"src pages cover positions [{start_page}, {end}) but decode reserved only "
            f"{num_dst_pages} dst_pages"
        )
    return range(max(start_page, skip_pages), end)


def plan_segments(
    src: KVLayout,
    dst: KVLayout,
    src_pages: list[int],
    dst_pages: list[int],
    *,
    start_page: int = 0,
    skip_pages: int = 0,
) -> list[list[Range]]:
    """Uncoalesced ranges grouped per request page position (for checksums and tests).

    `src_pages[i]` holds request position `start_page + i`; `dst_pages[p]` is decode's page for
    position p (the full page table, so it may be longer). Positions below `skip_pages` are
    already on decode (its prefix cache) and are left out.
    """
    if (
        src.page_size != dst.page_size
        or src.head_dim != dst.head_dim
        or src.itemsize != dst.itemsize
    ):
        raise PlanError(
            "src and dst layouts differ in page_size/head_dim/dtype; check the contract first"
        )
    if src.num_full_layers != dst.num_full_layers:
        raise PlanError(
            f"num_layers per page differs: src {src.num_full_layers} vs dst {dst.num_full_layers}"
        )
    runs = head_runs(src, dst)
    hb = src.head_bytes
    out: list[list[Range]] = []
    for pos in page_positions(len(src_pages), start_page, skip_pages, len(dst_pages)):
        s_page, d_page = src_pages[pos - start_page], dst_pages[pos]
        if not 0 <= s_page < src.num_pages or not 0 <= d_page < dst.num_pages:
            raise PlanError(
                f"page id out of range at position {pos}: src {s_page}/{src.num_pages}, dst "
                f"{d_page}/{dst.num_pages}"
            )
        segs: list[Range] = []
        if (
            runs == [(0, 0, src.num_kv_heads_local)]
            and src.num_kv_heads_local == dst.num_kv_heads_local
        ):
            segs.append(
                Range(src.offset(s_page), dst.offset(d_page), src.page_bytes)
            )  # same heads: whole page
        else:
            for layer in range(src.num_full_layers):
                for kv in range(src.planes):  # K and V, or the one MLA latent
                    for s_h, d_h, n in runs:
                        segs.append(
                            Range(
                                src.offset(s_page, layer, kv, s_h),
                                dst.offset(d_page, layer, kv, d_h),
                                n * hb,
                            )
                        )
        out.append(segs)
    return out


def plan_pages(
    src: KVLayout,
    dst: KVLayout,
    src_pages: list[int],
    dst_pages: list[int],
    *,
    start_page: int = 0,
    skip_pages: int = 0,
) -> list[Range]:
    """Coalesced byte ranges that move `src_pages` into decode's `dst_pages` (see plan_segments)."""
    segs = plan_segments(
        src, dst, src_pages, dst_pages, start_page=start_page, skip_pages=skip_pages
    )
    return coalesce([r for page in segs for r in page])


# ---- replay tails: groups whose state is not retained page by page ----------------------------


@dataclass(frozen=True)
class TokenRun:
    """`count` consecutive tokens starting at request position `first_token`,
    stored from ring `slot`."""

    slot: int
    first_token: int
    count: int


def sliding_window_tail(num_tokens: int, window: int, ring_tokens: int) -> list[TokenRun]:
    """The last `window` tokens of a ring buffer of `ring_tokens` slots (token p sits at p % ring).

    Split where the ring wraps; at most two runs.
    """
    if window <= 0 or ring_tokens < window:
        raise PlanError(f"need 0 < window ({window}) <= ring_tokens ({ring_tokens})")
    first = max(0, num_tokens - window)
    runs: list[TokenRun] = []
    pos = first
    while pos < num_tokens:
        slot = pos % ring_tokens
        n = min(num_tokens - pos, ring_tokens - slot)
        runs.append(TokenRun(slot, pos, n))
        pos += n
    return runs


def replay_tail(group: CacheGroup, num_tokens: int, ring_tokens: int = 0) -> list[TokenRun]:
    """What prefill must ship for `group` besides pages, so decode never re-feeds the prompt.

    FULL_ATTENTION: nothing (its pages are retained and travel with the page plan).
    SLIDING_WINDOW: the last `window` tokens of its ring (`ring_tokens` slots, default window).
    RECURRENT: the one state slot after the last prompt token.
    """
    if group.kind is CacheKind.FULL_ATTENTION:
        return []
    if group.kind is CacheKind.SLIDING_WINDOW:
        return sliding_window_tail(num_tokens, group.window, ring_tokens or group.window)
    return [TokenRun(0, num_tokens - 1, 1)] if num_tokens > 0 else []


def tail_ranges(
    runs: list[TokenRun], src_base: int, dst_base: int, token_bytes: int
) -> list[Range]:
    """Byte ranges of replay-tail runs between two rings with the same slot layout."""
    return coalesce(
        [
            Range(
                src_base + r.slot * token_bytes,
                dst_base + r.slot * token_bytes,
                r.count * token_bytes,
            )
            for r in runs
        ]
    )


def window_tail_pages(num_tokens: int, window: int, page_size: int, ring_pages: int) -> list[int]:
    """Ring page indices holding the last `window` of `num_tokens` tokens, oldest first.

    Token p sits in ring page (p // page_size) % ring_pages (see CacheGroup.ring_pages), so the
    tail is the pages of positions [max(0, num_tokens - window), num_tokens): at most ring_pages.
    """
    if window <= 0 or page_size <= 0 or ring_pages * page_size < window:
        raise PlanError(
            f"need window ({window}) > 0 and "
            f"ring_pages ({ring_pages}) * page_size ({page_size}) >= window"
        )
    if num_tokens <= 0:
        return []
    first, last = max(0, num_tokens - window) // page_size, (num_tokens - 1) // page_size
    return [p % ring_pages for p in range(first, last + 1)]


def plan_window_tail(
    src: KVLayout,
    dst: KVLayout,
    src_ring: list[int],
    dst_ring: list[int],
    ring_indices: list[int],
) -> list[list[Range]]:
    """Ranges that move ring pages `ring_indices` of a request's window ring, one list per index.

    `src_ring`/`dst_ring` are each side's window pages in ring order (the same length: both
    derive it from the contract's window and page size). Offsets are from each side's pool
    base (the window region sits at `window_base`), so these ranges travel like page ranges.
    Heterogeneous TP works as for full pages: the window region has the same head layout.
    """
    if len(src_ring) != len(dst_ring):
        raise PlanError(
            f"window rings differ in length: src {len(src_ring)} vs dst {len(dst_ring)} pages; "
            "both sides must derive ring_pages from the same window and page_size"
        )
    s_view, d_view = src.window_view(), dst.window_view()
    out: list[list[Range]] = []
    for idx in ring_indices:
        if not 0 <= idx < len(src_ring):
            raise PlanError(f"ring index {idx} outside a ring of {len(src_ring)} pages")
        segs = plan_segments(s_view, d_view, [src_ring[idx]], dst_ring, start_page=idx)
        out.append(
            [
                Range(r.src + src.window_base, r.dst + dst.window_base, r.length)
                for s in segs
                for r in s
            ]
        )
    return out
