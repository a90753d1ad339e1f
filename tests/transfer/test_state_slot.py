"""The recurrent-state group through transfer: the contract names it and its slot size, a room
ships the state slot as one range into decode's slot (checksummed), and a decode that has no
state slot for a layout that needs one — or the other way round — is refused."""

from __future__ import annotations

import random

import pytest
import torch

from tests.transfer.helpers import make_cluster, wait_finished
from transfer.contract import CacheGroup, CacheKind, ContractError, KVLayout, LayoutContract
from transfer.room import RoomState
from transfer.wire import contract_from_pb, contract_to_pb

PAGE, SLOT = 4, 192  # bytes of one state slot


def state_layout(num_pages: int, num_slots: int, slot_bytes: int = SLOT) -> KVLayout:
    """Layers 0 and 2 recurrent, 1 full attention; the state region after the pages."""
    groups = (CacheGroup(CacheKind.FULL_ATTENTION, (1,)),
              CacheGroup(CacheKind.RECURRENT, (0, 2), state_bytes=slot_bytes))
    pages = KVLayout(num_pages, 3, PAGE, 8, "float32", 2, groups=groups)
    base = -(-num_pages * pages.page_bytes // 64) * 64
    return KVLayout(num_pages, 3, PAGE, 8, "float32", 2, groups=groups, num_state_slots=num_slots,
                    state_base=base)


def test_layout_counts_no_pages_for_recurrent_layers_and_places_slots_after_them() -> None:
    lay = state_layout(10, 3)
    assert lay.num_full_layers == 1 and lay.page_bytes == 2 * 2 * PAGE * 8 * 4
    assert lay.state_offset(2) == lay.state_base + 2 * SLOT >= 10 * lay.page_bytes
    assert lay.pool_bytes == lay.state_base + 3 * SLOT
    with pytest.raises(ContractError, match="state slot 3"):
        lay.state_offset(3)
    with pytest.raises(ContractError, match="state_bytes must be > 0"):
        CacheGroup(CacheKind.RECURRENT, (0,))


def test_contract_carries_the_slot_size_and_refuses_another() -> None:
    def contract(lay: KVLayout) -> LayoutContract:
        return LayoutContract.from_layout(lay, model_name="m", model_fingerprint="f",
                                          backend="mooncake")

    ours = contract(state_layout(8, 2))
    assert contract_from_pb(contract_to_pb(ours)) == ours
    assert "state_bytes" in ours.canonical()
    with pytest.raises(ContractError, match="groups"):
        ours.check_compatible(contract(state_layout(8, 2, slot_bytes=SLOT * 2)))


def test_the_state_slot_lands_in_decodes_slot_with_the_pages() -> None:
    c = make_cluster("mooncake", state_layout(12, 2), state_layout(16, 4), checksum=True)
    try:
        rng = random.Random(3)
        src, dst = rng.sample(range(12), 3), rng.sample(range(16), 3)
        rx = c.decode[0].manager.create_receiver(0x51, c.prefill[0].addr, dst,
                                                 num_tokens=3 * PAGE, state_slot=3)
        tx = c.prefill[0].manager.create_sender(0x51)
        tx.send(src, start_page=0, last=True, first_token=5, state_slot=1)
        wait_finished([rx, tx])
        assert rx.state is RoomState.SUCCESS, rx.error
        p, d = c.prefill[0], c.decode[0]
        pl, dl = p.manager.layout, d.manager.layout
        got = d.pool[dl.state_offset(3) : dl.state_offset(3) + SLOT]
        assert torch.equal(got, p.pool[pl.state_offset(1) : pl.state_offset(1) + SLOT])
        assert not d.pool[dl.state_offset(2) : dl.state_offset(2) + SLOT].any()  # only its slot
        assert rx.stats.bytes == 3 * pl.page_bytes + SLOT
    finally:
        c.close()


def test_a_room_without_its_state_slot_is_refused() -> None:
    c = make_cluster("mooncake", state_layout(12, 2), state_layout(16, 4))
    try:
        with pytest.raises(ValueError, match="state_slot"):
            c.decode[0].manager.create_receiver(0x52, c.prefill[0].addr, [1], num_tokens=PAGE)
        tx = c.prefill[0].manager.create_sender(0x53)
        with pytest.raises(ValueError, match="needs state_slot"):
            tx.send([0], start_page=0, last=True, first_token=1)
        tx.abort("test done")
    finally:
        c.close()
