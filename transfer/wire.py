"""Conversions between the contract dataclasses and their bootstrap protobuf messages."""

from __future__ import annotations

from protocol import bootstrap_pb2 as pb
from transfer.contract import CacheGroup, CacheKind, ContractError, LayoutContract


def contract_to_pb(c: LayoutContract) -> pb.LayoutContract:
    return pb.LayoutContract(
        model_name=c.model_name, model_fingerprint=c.model_fingerprint, num_layers=c.num_layers,
        page_size=c.page_size, num_kv_heads_total=c.num_kv_heads_total,
        num_kv_heads_local=c.num_kv_heads_local, head_dim=c.head_dim, dtype=c.dtype,
        tp_rank=c.tp_rank, tp_size=c.tp_size, backend=c.backend,
        groups=[pb.CacheGroup(kind=g.kind.value, layers=list(g.layers), window=g.window,
                              latent_dim=g.latent_dim, state_bytes=g.state_bytes)
                for g in c.groups],
        hash=c.hash(), kv_scales=c.kv_scales, speculative=c.speculative, v_layout=c.v_layout,
    )


def contract_from_pb(m: pb.LayoutContract) -> LayoutContract:
    """Decode a peer's contract; ContractError if its hash does not match its own fields."""
    try:
        kinds = [CacheKind(g.kind) for g in m.groups]
    except ValueError as e:
        raise ContractError(f"contract.groups: unknown cache kind ({e}); expected one of "
                            f"{[k.value for k in CacheKind]}") from e
    groups = tuple(CacheGroup(kind, tuple(g.layers), g.window, g.latent_dim, g.state_bytes)
                   for kind, g in zip(kinds, m.groups, strict=True))  # ContractError names a field
    c = LayoutContract(
        model_name=m.model_name, model_fingerprint=m.model_fingerprint, num_layers=m.num_layers,
        page_size=m.page_size, num_kv_heads_total=m.num_kv_heads_total,
        num_kv_heads_local=m.num_kv_heads_local, head_dim=m.head_dim, dtype=m.dtype,
        tp_rank=m.tp_rank, tp_size=m.tp_size, backend=m.backend,
        groups=groups, kv_scales=m.kv_scales, speculative=m.speculative, v_layout=m.v_layout,
    )
    if m.hash != c.hash():
        raise ContractError(f"contract.hash {m.hash[:12]}... does not match its fields "
                            f"({c.hash()[:12]}...); the peer runs a different contract encoding "
                            "(upgrade both sides together)")
    return c
