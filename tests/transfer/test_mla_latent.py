"""MLA latent pages in the transfer layer: the contract's MLA_LATENT group, the plan's one copy
per destination rank under heterogeneous TP, and real writes over Mooncake loopback.

A latent pool is `data[num_pages, num_layers, page_size, latent_dim]`, described as one plane
of one replicated kv "head" of width latent_dim; every TP rank holds the same latent, so a
decode rank needs each page once, from prefill rank `decode_rank % prefill_tp`.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.transfer.helpers import make_cluster, wait_finished
from transfer.contract import CacheGroup, CacheKind, ContractError, KVLayout, LayoutContract
from transfer.plan import plan_pages
from transfer.room import RoomState
from transfer.wire import contract_from_pb, contract_to_pb

LAYERS, PAGE, LATENT = 3, 4, 40


def mla_layout(
    num_pages: int = 16,
    tp_rank: int = 0,
    tp_size: int = 1,
    latent: int = LATENT,
    dtype: str = "float32",
) -> KVLayout:
    group = CacheGroup(CacheKind.MLA_LATENT, tuple(range(LAYERS)), latent_dim=latent)
    return KVLayout(
        num_pages=num_pages,
        num_layers=LAYERS,
        page_size=PAGE,
        head_dim=latent,
        dtype=dtype,
        num_kv_heads_total=1,
        tp_rank=tp_rank,
        tp_size=tp_size,
        groups=(group,),
    )


def _contract(lay: KVLayout) -> LayoutContract:
    return LayoutContract.from_layout(
        lay, model_name="ds", model_fingerprint="fp", backend="mooncake"
    )


def test_page_bytes_follow_from_the_latent_width() -> None:
    lay = mla_layout(dtype="bfloat16")
    assert lay.planes == 1 and lay.heads == [0]
    assert lay.page_bytes == LAYERS * PAGE * LATENT * 2  # no heads, no K/V pair
    assert lay.offset(3, 2) == 3 * lay.page_bytes + 2 * PAGE * LATENT * 2
    assert (
        mla_layout(tp_rank=1, tp_size=2).page_bytes == lay.page_bytes * 2
    )  # float32: replicated whole


def test_contract_names_the_group_and_its_width_and_refuses_another() -> None:
    ours = _contract(mla_layout())
    groups = json.loads(ours.canonical())["groups"]
    assert groups == [
        {"kind": "mla_latent", "layers": [0, 1, 2], "window": 0, "latent_dim": LATENT}
    ]
    back = contract_from_pb(contract_to_pb(ours))
    assert back == ours and back.hash() == ours.hash()
    theirs = _contract(mla_layout(latent=48))
    with pytest.raises(ContractError, match="groups"):
        ours.check_compatible(theirs)
    # A K/V contract's canonical groups carry no latent_dim: hashes from before MLA stay valid.
    kv = LayoutContract.from_layout(
        KVLayout(8, 2, 4, 16, "float32", 2),
        model_name="m",
        model_fingerprint="f",
        backend="mooncake",
    )
    assert "latent_dim" not in kv.canonical()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"head_dim": 32}, "head_dim = latent_dim"),
        ({"num_kv_heads_total": 2}, "num_kv_heads_total = 1"),
        ({"groups": (CacheGroup(CacheKind.MLA_LATENT, (0, 1), latent_dim=LATENT),)}, "every layer"),
    ],
)
def test_bad_latent_layouts_are_refused_naming_the_field(
    change: dict[str, object], match: str
) -> None:
    fields = {
        "num_pages": 8,
        "num_layers": LAYERS,
        "page_size": PAGE,
        "head_dim": LATENT,
        "dtype": "float32",
        "num_kv_heads_total": 1,
        "groups": (CacheGroup(CacheKind.MLA_LATENT, tuple(range(LAYERS)), latent_dim=LATENT),),
    }
    with pytest.raises(ContractError, match=match):
        KVLayout(**{**fields, **change})  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="latent_dim"):
        CacheGroup(CacheKind.MLA_LATENT, (0,))  # an MLA group needs its width
    with pytest.raises(ContractError, match="latent_dim"):
        CacheGroup(CacheKind.FULL_ATTENTION, (0,), latent_dim=8)


@pytest.mark.parametrize("p_tp", [1, 2, 4])
@pytest.mark.parametrize("d_tp", [1, 2, 4])
def test_each_decode_rank_gets_one_copy_of_every_page(p_tp: int, d_tp: int) -> None:
    rng = random.Random(p_tp * 10 + d_tp)
    n, skip, pages = 6, 1, 12
    src_pages, dst_pages = rng.sample(range(pages), n), rng.sample(range(pages), n + 1)
    srcs = [mla_layout(pages, r, p_tp) for r in range(p_tp)]
    pools = [
        torch.randint(0, 256, (s.pool_bytes,), dtype=torch.uint8) for s in srcs
    ]  # rank-distinct bytes
    senders_per_dst = []
    for d_rank in range(d_tp):
        dst = mla_layout(pages, d_rank, d_tp)
        pool = torch.zeros(dst.pool_bytes, dtype=torch.uint8)
        hits = torch.zeros(dst.pool_bytes, dtype=torch.int32)
        senders = []
        for s, s_pool in zip(srcs, pools, strict=True):
            ranges = plan_pages(s, dst, src_pages, dst_pages, skip_pages=skip)
            if ranges:
                senders.append(s.tp_rank)
            for r in ranges:
                pool[r.dst : r.dst + r.length] = s_pool[r.src : r.src + r.length]
                hits[r.dst : r.dst + r.length] += 1
        assert senders == [d_rank % p_tp], "one source rank per destination rank"
        owner, pb = pools[d_rank % p_tp], dst.page_bytes
        for pos, (sp, dp) in enumerate(zip(src_pages, dst_pages, strict=False)):
            want = 0 if pos < skip else 1
            assert bool((hits[dp * pb : (dp + 1) * pb] == want).all()), (pos, d_rank)
            if pos >= skip:
                assert torch.equal(pool[dp * pb : (dp + 1) * pb], owner[sp * pb : (sp + 1) * pb])
        assert int(hits.sum()) == (n - skip) * pb  # nothing else is touched
        senders_per_dst.append(senders[0])
    if p_tp == d_tp:  # same TP: every source rank feeds its own counterpart
        assert senders_per_dst == list(range(p_tp))


@pytest.mark.slow
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["p-tp2-d-tp1", "p-tp1-d-tp2"])
def test_latent_pages_land_over_mooncake_one_copy_per_decode_rank(p_tp: int, d_tp: int) -> None:
    c = make_cluster(
        "mooncake",
        [mla_layout(24, r, p_tp) for r in range(p_tp)],
        [mla_layout(32, r, d_tp) for r in range(d_tp)],
        checksum=True,
    )
    try:
        rng = random.Random(7)
        n = 9
        src, dst = rng.sample(range(24), n), rng.sample(range(32), n + 1)
        receivers = [
            d.manager.create_receiver(0xD5, c.prefill[0].addr, dst, num_tokens=n * PAGE)
            for d in c.decode
        ]
        senders = [p.manager.create_sender(0xD5) for p in c.prefill]
        for s in senders:
            s.send(src[:4], start_page=0, last=False)
            s.send(src[4:], start_page=4, last=True, first_token=3, first_logprob=-0.5)
        wait_finished(receivers + senders)
        assert all(r.state is RoomState.SUCCESS for r in receivers + senders), [
            r.error for r in receivers
        ]
        pb = c.decode[0].manager.layout.page_bytes
        for d_rank, (d, recv) in enumerate(zip(c.decode, receivers, strict=True)):
            owner = c.prefill[d_rank % p_tp]
            for sp, dp in zip(src, dst, strict=False):
                assert torch.equal(
                    d.pool[dp * pb : (dp + 1) * pb], owner.pool[sp * pb : (sp + 1) * pb]
                )
            assert recv.stats.pages == n and recv.stats.bytes == n * pb  # exactly one copy
            assert recv.first_token == 3
        assert sum(p.manager.totals().bytes for p in c.prefill) == d_tp * n * pb
    finally:
        c.close()
