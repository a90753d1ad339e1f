"""Test helpers: real KV pools (torch byte tensors), real gRPC servers, real backends."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from transfer.contract import KVLayout
from transfer.manager import KVTransferManager
from transfer.room import Room, RoomState


@dataclass
class Rank:
    """One manager with its pool and (prefill) its gRPC server."""

    manager: KVTransferManager
    pool: torch.Tensor  # uint8 [pool_bytes]
    server: grpc.Server | None = None
    addr: str = ""

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)
        self.manager.close()


@dataclass
class Cluster:
    prefill: list[Rank] = field(default_factory=list)
    decode: list[Rank] = field(default_factory=list)

    @property
    def bootstrap_addr(self) -> str:
        return ",".join(r.addr for r in self.prefill)

    def close(self) -> None:
        for r in self.decode + self.prefill:
            r.close()


def layout(
    num_pages: int = 16,
    num_layers: int = 2,
    page_size: int = 4,
    head_dim: int = 8,
    dtype: str = "float32",
    heads: int = 2,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVLayout:
    return KVLayout(
        num_pages=num_pages,
        num_layers=num_layers,
        page_size=page_size,
        head_dim=head_dim,
        dtype=dtype,
        num_kv_heads_total=heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def make_rank(
    role: str,
    lay: KVLayout,
    config: TransferConfig,
    *,
    fingerprint: str = "fp",
    peer_id: str = "",
    faults: TransferFaults | None = None,
    seed: int = 0,
    port: int = 0,
) -> Rank:
    g = torch.Generator().manual_seed(seed)
    pool = (
        torch.randint(0, 256, (lay.pool_bytes,), dtype=torch.uint8, generator=g)
        if role == "prefill"
        else torch.zeros(lay.pool_bytes, dtype=torch.uint8)
    )
    mgr = KVTransferManager(
        config,
        lay,
        role=role,
        kv_ptr=pool.data_ptr(),
        kv_nbytes=pool.numel(),
        host="127.0.0.1",
        model_fingerprint=fingerprint,
        model_name="tiny",
        peer_id=peer_id,
        faults=faults or TransferFaults(),
    )
    rank = Rank(mgr, pool)
    if role == "prefill":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        mgr.add_to_server(server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        rank.server, rank.addr = server, f"127.0.0.1:{bound}"
    return rank


def make_cluster(
    backend: str,
    prefill: KVLayout | list[KVLayout],
    decode: KVLayout | list[KVLayout],
    faults: TransferFaults | None = None,
    **cfg: object,
) -> Cluster:
    config = TransferConfig(backend=backend, **cfg)  # type: ignore[arg-type]
    pl = prefill if isinstance(prefill, list) else [prefill]
    dl = decode if isinstance(decode, list) else [decode]
    c = Cluster()
    try:
        c.prefill = [
            make_rank("prefill", lay, config, seed=i + 1, faults=faults) for i, lay in enumerate(pl)
        ]
        if len(c.prefill) > 1:
            for r in c.prefill:
                r.manager.set_tp_bootstrap_addrs([p.addr for p in c.prefill])
        c.decode = [
            make_rank("decode", lay, config, peer_id=f"decode-{i}") for i, lay in enumerate(dl)
        ]
    except BaseException:
        c.close()
        raise
    return c


def wait_finished(rooms: list[Room], timeout_s: float = 10.0) -> None:
    """Poll until every room reaches a terminal state (a real deadline, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.poll().finished for r in rooms):
        assert time.monotonic() < deadline, [(r.room, r.state, r.error) for r in rooms]
        time.sleep(0.005)


def wait_state(room: Room, state: RoomState, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while room.poll() is not state:
        assert time.monotonic() < deadline, (room.state, room.error)
        assert not room.state.finished or state.finished, (room.state, room.error)
        time.sleep(0.005)


def page_bytes_of(rank: Rank, page: int) -> bytes:
    pb = rank.manager.layout.page_bytes
    return bytes(rank.pool[page * pb : (page + 1) * pb].numpy())


def head_slice(rank: Rank, page: int, layer: int, kv: int, global_head: int) -> bytes:
    lay = rank.manager.layout
    off = lay.offset(page, layer, kv, lay.heads.index(global_head))
    return bytes(rank.pool[off : off + lay.head_bytes].numpy())
