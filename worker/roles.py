"""Wiring of the PD roles: the worker's KV memory described to the transfer layer.

`attach` builds the rank's `KVLayout` from the engine's KV cache, opens the transfer manager
(which registers that memory with the backend once), serves the bootstrap service on prefill
workers, and returns the role's hooks for the scheduler.

The bootstrap service runs on its own (thread-pool) gRPC server: a registration stream lives
as long as its room and blocks a thread, which must never be the worker's event loop.
`transfer.bootstrap_port` fixes its port (0 = any free port; GetInfo reports the address).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import cast

import grpc

from protocol.tls import add_port
from transfer.contract import KVLayout
from transfer.manager import KVTransferManager
from worker.config import WorkerConfig
from worker.decode import DecodeRole
from worker.engine import Engine
from worker.kv_cache import cache_groups
from worker.prefill import PrefillRole
from worker.rank_rooms import rank_peer_id
from worker.scheduler import RoleHooks


def kv_layout(engine: Engine, config: WorkerConfig) -> KVLayout:
    shape = engine.kv.shape
    return KVLayout(
        num_pages=shape.num_pages,
        num_layers=shape.num_layers,
        page_size=shape.page_size,
        head_dim=shape.head_dim,
        dtype=str(shape.dtype).removeprefix("torch."),
        num_kv_heads_total=engine.spec.num_kv_heads,
        tp_rank=config.parallel.tp_rank,
        tp_size=config.parallel.tp_size,
        groups=cache_groups(shape),
        num_window_pages=shape.num_window_pages,
    )


MAX_LIVE_ROOMS = 1024  # bootstrap threads: registrations served at once


def attach(engine: Engine, config: WorkerConfig, info: dict[str, str]) -> RoleHooks:
    """Open the transfer manager for `config.role` and return the role's hooks.

    `info` receives what GetInfo reports: bootstrap_addr (prefill), transfer_backend, epoch,
    contract_hash.
    """
    manager = KVTransferManager(
        config.transfer,
        kv_layout(engine, config),
        role=config.role,
        kv_ptr=engine.kv.data_ptr(),
        kv_nbytes=engine.kv.nbytes(),
        host=config.host,
        model_fingerprint=engine.spec.fingerprint,
        model_name=engine.spec.architecture,
        peer_id=rank_peer_id(config, dp_rank=0),
        tls=config.tls,
    )
    info["transfer_backend"] = config.transfer.backend
    info["epoch"] = str(manager.epoch)
    info["contract_hash"] = manager.contract.compat_hash()  # GetInfo: what a gateway compares
    role: RoleHooks
    if config.role == "prefill":
        server = grpc.server(ThreadPoolExecutor(max_workers=MAX_LIVE_ROOMS, thread_name_prefix="bootstrap"))
        manager.add_to_server(server)
        port = add_port(server, f"{config.host}:{config.transfer.bootstrap_port}", config.tls)
        if port == 0:
            raise RuntimeError(f"cannot bind the bootstrap service on {config.host}:{config.transfer.bootstrap_port}; "
                               "set transfer.bootstrap_port to a free port")
        server.start()
        info["bootstrap_addr"] = f"{config.transfer.advertise_host or config.host}:{port}"
        role = PrefillRole(engine, _on_every_rank(engine, manager, info), server)
    else:
        role = DecodeRole(engine, _on_every_rank(engine, manager, info))
    return role


def _on_every_rank(engine: Engine, manager: KVTransferManager, info: dict[str, str]) -> KVTransferManager:
    """Multi-rank worker: rooms repeat on every rank; GetInfo lists every rank's bootstrap address."""
    if engine.tp is None:
        return manager
    facade, addrs = engine.tp.wrap_manager(manager, info.get("bootstrap_addr", ""), engine.group_of_room)
    if addrs:
        info["bootstrap_addr"] = addrs
    return cast(KVTransferManager, facade)  # same calls the roles make (worker/rank_rooms.py)
