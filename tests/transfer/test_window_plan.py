"""The window region of a KV layout and the planner for a ring's retained tail (pure functions)."""

from __future__ import annotations

import pytest

from transfer.contract import CacheGroup, CacheKind, ContractError, KVLayout, LayoutContract
from transfer.plan import PlanError, plan_window_tail, window_tail_pages

GROUPS = (
    CacheGroup(CacheKind.FULL_ATTENTION, (0,)),
    CacheGroup(CacheKind.SLIDING_WINDOW, (1, 2, 3), 8),
)


def _layout(
    num_pages: int = 10, num_window_pages: int = 6, tp_rank: int = 0, tp_size: int = 1
) -> KVLayout:
    return KVLayout(
        num_pages=num_pages,
        num_layers=4,
        page_size=4,
        head_dim=16,
        dtype="float32",
        num_kv_heads_total=2,
        tp_rank=tp_rank,
        tp_size=tp_size,
        groups=GROUPS,
        num_window_pages=num_window_pages,
    )


def test_window_region_follows_the_full_pages() -> None:
    lay = _layout()
    layer = 2 * 2 * 4 * 16 * 4  # K+V, 2 heads, 4 tokens, 16 dims, fp32
    assert lay.page_bytes == layer  # full pages carry the one full layer only
    assert lay.window_base == 10 * layer
    assert lay.window_view().page_bytes == 3 * layer
    assert lay.pool_bytes == 10 * layer + 6 * 3 * layer
    assert GROUPS[1].ring_pages(4) == 3


def test_window_layout_is_checked() -> None:
    with pytest.raises(ContractError, match="num_window_pages"):
        KVLayout(
            num_pages=1,
            num_layers=4,
            page_size=4,
            head_dim=16,
            dtype="float32",
            num_kv_heads_total=2,
            num_window_pages=3,
        )  # no sliding_window group
    with pytest.raises(ContractError, match="full_attention"):
        KVLayout(
            num_pages=1,
            num_layers=3,
            page_size=4,
            head_dim=16,
            dtype="float32",
            num_kv_heads_total=2,
            groups=(GROUPS[1],),
            num_window_pages=3,
        )
    # The window is in the contract: a different window is refused at bootstrap.
    a = LayoutContract.from_layout(
        _layout(), model_name="m", model_fingerprint="f", backend="mooncake"
    )
    other = (GROUPS[0], CacheGroup(CacheKind.SLIDING_WINDOW, (1, 2, 3), 16))
    b = LayoutContract.from_layout(
        KVLayout(
            num_pages=10,
            num_layers=4,
            page_size=4,
            head_dim=16,
            dtype="float32",
            num_kv_heads_total=2,
            groups=other,
            num_window_pages=5,
        ),
        model_name="m",
        model_fingerprint="f",
        backend="mooncake",
    )
    assert any(d.startswith("groups") for d in a.mismatches(b))


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (0, []),
        (3, [0]),
        (8, [0, 1]),
        (9, [0, 1, 2]),
        (12, [1, 2]),
        (13, [1, 2, 0]),
        (30, [2, 0, 1]),
    ],
)
def test_tail_pages_are_the_last_window_tokens(num_tokens: int, expected: list[int]) -> None:
    assert window_tail_pages(num_tokens, 8, 4, 3) == expected


def test_tail_plan_maps_ring_index_to_ring_index() -> None:
    src, dst = _layout(num_window_pages=6), _layout(num_pages=20, num_window_pages=9)
    src_ring, dst_ring = [5, 0, 3], [8, 2, 7]
    (first, second) = plan_window_tail(src, dst, src_ring, dst_ring, [2, 0])
    wp = src.window_view().page_bytes
    assert first == [type(first[0])(src.window_base + 3 * wp, dst.window_base + 7 * wp, wp)]
    assert second[0].src == src.window_base + 5 * wp and second[0].dst == dst.window_base + 8 * wp
    with pytest.raises(PlanError, match="rings differ"):
        plan_window_tail(src, dst, src_ring, dst_ring[:2], [0])


def test_tail_plan_splits_heads_for_heterogeneous_tp() -> None:
    src = _layout()
    dst = [_layout(tp_rank=r, tp_size=2) for r in (0, 1)]
    per_rank = [plan_window_tail(src, d, [0, 1, 2], [0, 1, 2], [1])[0] for d in dst]
    head = 4 * 16 * 4
    # 3 window layers x K/V, one head each, for each decode rank; disjoint source slices.
    assert all(len(ranges) == 6 and all(r.length == head for r in ranges) for ranges in per_rank)
    assert {r.src for r in per_rank[0]}.isdisjoint({r.src for r in per_rank[1]})
