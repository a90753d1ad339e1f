"""Transfer plan: pure functions, checked by simulating the writes on byte arrays."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.contract import CacheGroup, CacheKind, KVLayout
from transfer.plan import (
    PlanError,
    Range,
    TokenRun,
    coalesce,
    head_runs,
    plan_pages,
    plan_segments,
    replay_tail,
    sliding_window_tail,
    split_ranges,
    tail_ranges,
)

HEAD_DIM, PAGE_SIZE = 2, 2  # tiny so that hypothesis explores many layouts per second


def _layouts(
    heads: int, tp: int, pages: int, layers: int, itemsize_dtype: str = "float32"
) -> list[KVLayout]:
    return [
        KVLayout(
            num_pages=pages,
            num_layers=layers,
            page_size=PAGE_SIZE,
            head_dim=HEAD_DIM,
            dtype=itemsize_dtype,
            num_kv_heads_total=heads,
            tp_rank=r,
            tp_size=tp,
        )
        for r in range(tp)
    ]


def _src_pool(lay: KVLayout, ref: torch.Tensor, src_pages: list[int]) -> torch.Tensor:
    """A source rank's pool: ref[pos, layer, kv, head, head_bytes] placed at its pages;
    noise elsewhere."""
    pool = torch.randint(
        0,
        256,
        (lay.num_pages, lay.num_layers, 2, lay.num_kv_heads_local, lay.head_bytes),
        dtype=torch.uint8,
    )
    for pos, page in enumerate(src_pages):
        pool[page] = ref[pos][:, :, lay.heads]
    return pool.flatten()


def _apply(ranges: list[Range], src: torch.Tensor, dst: torch.Tensor, hits: torch.Tensor) -> None:
    for r in ranges:
        dst[r.dst : r.dst + r.length] = src[r.src : r.src + r.length]
        hits[r.dst : r.dst + r.length] += 1


@st.composite
def _scenario(draw: st.DrawFn) -> tuple[int, int, int, int, int, list[int], list[int], int, int]:
    heads = draw(st.sampled_from([1, 2, 4]))
    p_tp = draw(st.sampled_from([1, 2, 4, 8]))
    d_tp = draw(st.sampled_from([1, 2, 4, 8]))
    layers = draw(st.integers(1, 3))
    n = draw(st.integers(1, 6))
    pages = 8
    src_pages = draw(st.permutations(range(pages)))[:n]
    dst_pages = draw(st.permutations(range(pages)))[
        : n + draw(st.integers(0, 1))
    ]  # +1: first token's page
    skip = draw(st.integers(0, n))
    start = draw(st.integers(0, n))  # a chunk covering positions [start, n)
    return heads, p_tp, d_tp, layers, pages, src_pages, dst_pages, skip, start


@settings(max_examples=150, deadline=None)
@given(_scenario())
def test_every_needed_dst_byte_written_once_with_the_right_head(case: tuple) -> None:
    heads, p_tp, d_tp, layers, pages, src_pages, dst_pages, skip, start = case
    if (p_tp > heads and p_tp % heads) or (d_tp > heads and d_tp % heads):
        return
    srcs, dsts = _layouts(heads, p_tp, pages, layers), _layouts(heads, d_tp, pages, layers)
    n = len(src_pages)
    hb = srcs[0].head_bytes
    ref = torch.randint(0, 256, (n, layers, 2, heads, hb), dtype=torch.uint8)
    chunk = src_pages[start:]
    for d in dsts:
        pool = torch.zeros(d.pool_bytes, dtype=torch.uint8)
        hits = torch.zeros(d.pool_bytes, dtype=torch.int32)
        for s in srcs:
            ranges = plan_pages(s, d, chunk, dst_pages, start_page=start, skip_pages=skip)
            _apply(ranges, _src_pool(s, ref, src_pages), pool, hits)
        view = pool.view(pages, layers, 2, d.num_kv_heads_local, hb)
        hview = hits.view(pages, layers, 2, d.num_kv_heads_local, hb)
        wanted = set(range(max(start, skip), n))
        for pos, page in enumerate(dst_pages):
            if pos in wanted:
                assert torch.equal(view[page], ref[pos][:, :, d.heads]), (pos, page)
                assert bool((hview[page] == 1).all()), "every byte exactly once"
        untouched = [p for p in range(pages) if p not in {dst_pages[q] for q in wanted}]
        assert int(hview[untouched].sum()) == 0, "nothing outside the needed dst pages"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(1, 5)), max_size=20))
def test_coalesce_preserves_the_byte_stream(raw: list[tuple[int, int, int]]) -> None:
    ranges = [Range(s, d, n) for s, d, n in raw]
    merged = coalesce(ranges)

    def stream(rs: list[Range]) -> list[tuple[int, int]]:
        return [(r.src + i, r.dst + i) for r in rs for i in range(r.length)]

    assert stream(merged) == stream(ranges) and len(merged) <= len(ranges)
    assert all(
        not (a.src + a.length == b.src and a.dst + a.length == b.dst)
        for a, b in zip(merged, merged[1:], strict=False)
    )


def test_same_tp_consecutive_pages_coalesce_into_one_range() -> None:
    (s,), (d,) = _layouts(2, 1, 16, 3), _layouts(2, 1, 16, 3)
    ranges = plan_pages(s, d, [4, 5, 6, 9], [10, 11, 12, 13])
    assert ranges == [
        Range(4 * s.page_bytes, 10 * d.page_bytes, 3 * s.page_bytes),
        Range(9 * s.page_bytes, 13 * d.page_bytes, s.page_bytes),
    ]


def test_split_ranges_cuts_long_ranges_only() -> None:
    assert split_ranges([Range(0, 100, 10), Range(50, 0, 3)], 4) == [
        Range(0, 100, 4),
        Range(4, 104, 4),
        Range(8, 108, 2),
        Range(50, 0, 3),
    ]


def test_skip_pages_leaves_decode_prefix_alone() -> None:
    (s,), (d,) = _layouts(1, 1, 8, 1), _layouts(1, 1, 8, 1)
    assert plan_pages(s, d, [0, 1, 2], [5, 6, 7], skip_pages=2) == [
        Range(2 * s.page_bytes, 7 * d.page_bytes, s.page_bytes)
    ]
    assert plan_pages(s, d, [0, 1], [5, 6, 7], skip_pages=2) == []


def test_tp_split_and_merge_head_runs() -> None:
    p2, d1 = _layouts(4, 2, 4, 1), _layouts(4, 1, 4, 1)
    assert head_runs(p2[0], d1[0]) == [(0, 0, 2)] and head_runs(p2[1], d1[0]) == [(0, 2, 2)]
    assert head_runs(d1[0], p2[1]) == [(2, 0, 2)]


def test_only_the_first_replica_sends() -> None:
    p4, d1 = _layouts(2, 4, 4, 1), _layouts(2, 1, 4, 1)  # ranks 0,1 hold head 0; ranks 2,3 head 1
    assert [head_runs(p, d1[0]) for p in p4] == [[(0, 0, 1)], [], [(0, 1, 1)], []]
    d4 = _layouts(2, 4, 4, 1)  # every decode replica still receives its head
    assert [head_runs(d1[0], d) for d in d4] == [[(0, 0, 1)], [(0, 0, 1)], [(1, 0, 1)], [(1, 0, 1)]]


def test_inconsistent_inputs_are_refused() -> None:
    (s,), (d,) = _layouts(1, 1, 4, 1), _layouts(1, 1, 4, 1)
    with pytest.raises(PlanError, match="dst_pages"):
        plan_pages(s, d, [0, 1, 2], [0, 1])
    with pytest.raises(PlanError, match="out of range"):
        plan_pages(s, d, [9], [0])
    (other,) = _layouts(1, 1, 4, 2)
    with pytest.raises(PlanError, match="num_layers"):
        plan_pages(s, other, [0], [0])
    assert len(plan_segments(s, d, [0, 1], [2, 3])) == 2


def test_sliding_window_tail_wraps_the_ring() -> None:
    assert sliding_window_tail(5, window=8, ring_tokens=8) == [TokenRun(0, 0, 5)]
    assert sliding_window_tail(10, window=4, ring_tokens=4) == [
        TokenRun(2, 6, 2),
        TokenRun(0, 8, 2),
    ]
    assert sliding_window_tail(20, window=4, ring_tokens=8) == [TokenRun(0, 16, 4)]
    with pytest.raises(PlanError):
        sliding_window_tail(3, window=8, ring_tokens=4)


@given(st.integers(0, 200), st.integers(1, 32), st.integers(0, 16))
def test_sliding_window_tail_is_the_last_window_tokens(
    num_tokens: int, window: int, extra: int
) -> None:
    ring = window + extra
    runs = sliding_window_tail(num_tokens, window, ring)
    positions = [r.first_token + i for r in runs for i in range(r.count)]
    assert positions == list(range(max(0, num_tokens - window), num_tokens))
    assert all(r.slot == r.first_token % ring and r.slot + r.count <= ring for r in runs)


def test_replay_tail_by_kind() -> None:
    assert replay_tail(CacheGroup(CacheKind.FULL_ATTENTION, (0,)), 100) == []
    assert replay_tail(CacheGroup(CacheKind.SLIDING_WINDOW, (1,), window=4), 10) == [
        TokenRun(2, 6, 2),
        TokenRun(0, 8, 2),
    ]
    assert replay_tail(CacheGroup(CacheKind.RECURRENT, (2,), state_bytes=64), 10) == [
        TokenRun(0, 9, 1)
    ]
    assert tail_ranges([TokenRun(2, 6, 2), TokenRun(0, 8, 2)], 1000, 5000, 16) == [
        Range(1032, 5032, 32),
        Range(1000, 5000, 32),
    ]
