"""Wiring of the PD roles: the worker's KV memory described to the transfer layer.

`attach` builds the rank's `KVLayout` from the engine's KV cache, opens the transfer manager
(which registers that memory with the backend once), serves the bootstrap service on prefill
workers (its own thread-pool server: `KVTransferManager.serve_bootstrap`), and returns the
role's hooks for the scheduler. `transfer.bootstrap_port` fixes its port (0 = any free port;
GetInfo reports the address).
"""

from __future__ import annotations

from typing import cast

from transfer.manager import KVTransferManager
from worker.config import WorkerConfig
from worker.decode import DecodeRole
from worker.engine import Engine
from worker.kv_cache import transfer_layout
from worker.prefill import PrefillRole
from worker.rank_rooms import rank_peer_id
from worker.scheduler import RoleHooks


def attach(engine: Engine, config: WorkerConfig, info: dict[str, str]) -> RoleHooks:
    """Open the transfer manager for `config.role` and return the role's hooks.

    `info` receives what GetInfo reports: bootstrap_addr (prefill), transfer_backend, epoch,
    contract_hash.
    """
    par = config.parallel
    manager = KVTransferManager(
        config.transfer,
        transfer_layout(engine.kv.shape, engine.spec.num_kv_heads, par.tp_rank, par.tp_size),
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
    page_size = config.cache.page_size
    if config.role == "prefill":
        server, port = manager.serve_bootstrap(config.host, config.transfer.bootstrap_port)
        info["bootstrap_addr"] = f"{config.transfer.advertise_host or config.host}:{port}"
        return PrefillRole(_on_every_rank(engine, manager, info), server, page_size=page_size,
                           layerwise_interval=config.transfer.layerwise_interval)
    return DecodeRole(_on_every_rank(engine, manager, info), page_size=page_size,
                      hold_every_s=config.transfer.bootstrap_timeout_s / 3)


def _on_every_rank(engine: Engine, manager: KVTransferManager,
                   info: dict[str, str]) -> KVTransferManager:
    """Multi-rank worker: rooms repeat on every rank; GetInfo lists every rank's bootstrap
    address."""
    if engine.tp is None:
        return manager
    facade, addrs = engine.tp.wrap_manager(manager, info.get("bootstrap_addr", ""),
                                           engine.group_of_room)
    if addrs:
        info["bootstrap_addr"] = addrs
    return cast(KVTransferManager, facade)  # same calls the roles make (worker/rank_rooms.py)
