"""FP8 KV pages in the layout contract: the KV dtype and the K/V scales' label must match, or
decode's registration is refused at bootstrap naming the field (no conversion on the fly)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.transfer.helpers import layout, make_cluster, wait_finished
from transfer.contract import ContractError, LayoutContract
from transfer.room import RoomState
from transfer.wire import contract_from_pb, contract_to_pb


def _fp8(scales: str = "1.0") -> object:
    return dataclasses.replace(layout(dtype="float8_e4m3fn"), kv_scales=scales)


def _contract(lay: object) -> LayoutContract:
    return LayoutContract.from_layout(
        lay,
        model_name="tiny",
        model_fingerprint="fp",  # type: ignore[arg-type]
        backend="mooncake",
    )


def test_kv_dtype_and_scales_are_compatibility_fields() -> None:
    plain, f8 = _contract(layout()), _contract(_fp8())
    assert f8.layout().itemsize == 1 and f8.layout().page_bytes * 4 == plain.layout().page_bytes
    with pytest.raises(ContractError) as e:
        plain.check_compatible(f8)
    assert "dtype: 'float32' != 'float8_e4m3fn'" in str(
        e.value
    ) and "kv_scales: '' != '1.0'" in str(e.value)
    with pytest.raises(ContractError, match=r"kv_scales: '1.0' != 'checkpoint per-head sha256:ab'"):
        f8.check_compatible(_contract(_fp8("checkpoint per-head sha256:ab")))
    assert contract_from_pb(contract_to_pb(f8)) == f8  # the label crosses the wire, hash checked
    # Pages that are not FP8 keep the canonical encoding (and hash) they had before the field.
    assert "kv_scales" not in plain.canonical() and '"kv_scales":"1.0"' in f8.canonical()


@pytest.mark.parametrize(
    "prefill_layout,decode_layout",
    [
        (layout(), _fp8()),  # float32 prefill, FP8 decode
        (_fp8(), _fp8("checkpoint per-tensor sha256:00")),  # both FP8, other scales
    ],
)
def test_bootstrap_refuses_a_decode_with_other_kv_pages(
    prefill_layout: object, decode_layout: object
) -> None:
    """Over a real backend: the room fails at registration, INVALID_ARGUMENT naming the field."""
    c = make_cluster("mooncake", prefill_layout, decode_layout)  # type: ignore[arg-type]
    try:
        send = c.prefill[0].manager.create_sender(7)
        recv = c.decode[0].manager.create_receiver(7, c.bootstrap_addr, [0], num_tokens=3)
        wait_finished([recv])
        assert recv.state is RoomState.FAILED and "INVALID_ARGUMENT" in (recv.error or "")
        assert "kv_scales" in (recv.error or "")
        send.abort("test over")
    finally:
        c.close()


def test_the_v_byte_order_of_fp8_pages_is_a_compatibility_field() -> None:
    """FP8 pages keep V token-major (worker/kv_cache.py); the contract says so, so a peer that
    keeps them feature-major (a build from before, whose contract has no v_layout) is refused
    naming the field instead of reading V's bytes in the wrong order."""
    f8 = _contract(_fp8())
    assert f8.v_layout == "token_major" and '"v_layout":"token_major"' in f8.canonical()
    assert _contract(layout()).v_layout == "" and "v_layout" not in _contract(layout()).canonical()
    older = dataclasses.replace(f8, v_layout="")
    assert contract_from_pb(contract_to_pb(older)) == older  # its own hash still checks out
    with pytest.raises(ContractError, match=r"v_layout: 'token_major' != ''"):
        f8.check_compatible(contract_from_pb(contract_to_pb(older)))
    assert contract_from_pb(contract_to_pb(f8)) == f8
