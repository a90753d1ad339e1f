"""Layout contract: hashing, compatibility, head placement, wire round trip."""

from __future__ import annotations

import dataclasses

import pytest

from transfer.contract import (
    CacheGroup,
    CacheKind,
    ContractError,
    KVLayout,
    LayoutContract,
    heads_of_rank,
)
from transfer.wire import contract_from_pb, contract_to_pb


def _contract(**kw: object) -> LayoutContract:
    lay = KVLayout(
        num_pages=8,
        num_layers=4,
        page_size=16,
        head_dim=32,
        dtype="float32",
        num_kv_heads_total=2,
        tp_rank=int(kw.pop("tp_rank", 0)),
        tp_size=int(kw.pop("tp_size", 1)),
    )  # type: ignore[call-overload]
    c = LayoutContract.from_layout(
        lay, model_name="tiny", model_fingerprint="abc", backend="mooncake"
    )
    return dataclasses.replace(c, **kw)  # type: ignore[arg-type]


def test_hash_is_stable_sha256_and_field_sensitive() -> None:
    a, b = _contract(), _contract()
    assert a.hash() == b.hash() and len(a.hash()) == 64
    assert a.hash() != _contract(page_size=32).hash()
    # A known value pins the canonical encoding: a change here breaks mixed-version clusters.
    assert a.canonical().startswith(
        '{"backend":"mooncake","dtype":"float32","groups":[{"kind":"full_attention"'
    )


def test_heterogeneous_tp_is_compatible_but_hash_differs() -> None:
    p, d = _contract(tp_size=2, tp_rank=1), _contract()
    p.check_compatible(d)
    assert p.compat_hash() == d.compat_hash() and p.hash() != d.hash()
    assert p.num_kv_heads_local == 1 and d.num_kv_heads_local == 2


def test_mismatch_names_every_differing_field() -> None:
    with pytest.raises(ContractError) as e:
        _contract().check_compatible(
            _contract(page_size=32, dtype="bfloat16", model_fingerprint="zzz")
        )
    msg = str(e.value)
    assert "page_size: 16 != 32" in msg and "dtype" in msg and "model_fingerprint" in msg
    assert "num_layers" not in msg


def test_groups_are_part_of_the_contract() -> None:
    window = (
        CacheGroup(CacheKind.FULL_ATTENTION, (0, 2)),
        CacheGroup(CacheKind.SLIDING_WINDOW, (1, 3), window=64),
    )
    with pytest.raises(ContractError, match="groups"):
        _contract().check_compatible(_contract(groups=window))
    with pytest.raises(ContractError, match="window must be > 0"):
        CacheGroup(CacheKind.SLIDING_WINDOW, (1,))


def test_wire_round_trip_and_tampered_hash() -> None:
    c = _contract(groups=(CacheGroup(CacheKind.RECURRENT, (0, 1, 2, 3), state_bytes=4096),))
    m = contract_to_pb(c)
    assert contract_from_pb(m) == c
    m.page_size = 8
    with pytest.raises(ContractError, match="does not match its fields"):
        contract_from_pb(m)


@pytest.mark.parametrize(
    ("total", "tp", "expected"),
    [
        (8, 1, [list(range(8))]),
        (8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (2, 4, [[0], [0], [1], [1]]),
        (1, 2, [[0], [0]]),
    ],
)
def test_heads_of_rank(total: int, tp: int, expected: list[list[int]]) -> None:
    assert [heads_of_rank(total, tp, r) for r in range(tp)] == expected


def test_bad_layouts_are_refused_with_the_field() -> None:
    with pytest.raises(ContractError, match="divisible"):
        heads_of_rank(6, 4, 0)
    with pytest.raises(ContractError, match="KVLayout.dtype"):
        KVLayout(
            num_pages=1,
            num_layers=1,
            page_size=1,
            head_dim=1,
            dtype="float64",
            num_kv_heads_total=1,
        )
    with pytest.raises(ContractError, match="KVLayout.tp_rank"):
        KVLayout(
            num_pages=1,
            num_layers=1,
            page_size=1,
            head_dim=1,
            dtype="float32",
            num_kv_heads_total=1,
            tp_size=2,
            tp_rank=2,
        )


def test_offsets_match_the_worker_tensor_layout() -> None:
    import torch

    lay = KVLayout(
        num_pages=3,
        num_layers=2,
        page_size=4,
        head_dim=8,
        dtype="float32",
        num_kv_heads_total=4,
        tp_size=2,
        tp_rank=1,
    )
    # data: [num_pages, num_layers, 2, heads_local, page_size, head_dim], as in worker/kv_cache.py
    data = torch.arange(3 * 2 * 2 * 2 * 4 * 8, dtype=torch.float32).reshape(3, 2, 2, 2, 4, 8)
    assert lay.pool_bytes == data.numel() * 4
    flat = data.view(torch.uint8).flatten()
    off = lay.offset(2, 1, 0, 1)
    got = flat[off : off + lay.head_bytes].view(torch.float32)
    assert torch.equal(got, data[2, 1, 0, 1].flatten())
