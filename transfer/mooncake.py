"""Mooncake Transfer Engine backend: P2P handshake (no metadata server), tcp or rdma.

Mooncake reports every failure as return code -1, never an exception, so each call's code is
checked here and turned into BackendError naming the call.
"""

from __future__ import annotations

import os
from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus
from transfer.config import TransferConfigError


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(self, host: str, *, protocol: str = "tcp", ib_device: str = "") -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO logs flood worker output
        from mooncake.engine import TransferEngine

        if protocol == "rdma" and not ib_device:
            raise TransferConfigError(
                "transfer.ib_device is empty and DISAGGREGATION_IB_DEVICE is unset; "
                "rdma needs the RDMA device names (e.g. mlx5_0,mlx5_1), or use protocol tcp"
            )
        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, ib_device if protocol == "rdma" else "")
        if rc != 0:
            raise BackendError(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self._name = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[int] = []

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._te.register_memory(ptr, nbytes)
        if rc != 0:
            raise BackendError(f"mooncake: register_memory(0x{ptr:x}, {nbytes}) returned {rc}")
        self._registered.append(ptr)

    def connect(self, agent_name: str, metadata: bytes) -> None:
        pass  # the P2P handshake happens on the first write to "host:rpc_port"

    def forget(self, agent_name: str) -> None:
        pass  # sessions are per address; a restarted peer answers on its new rpc port

    def submit(self, peer: str, spans: list[Span]) -> Any:
        src, dst, lengths = (list(col) for col in zip(*spans, strict=True))
        batch = self._te.batch_transfer_async_write(peer, src, dst, lengths)
        return batch if batch > 0 else None  # 0/-1: the batch could not be submitted

    def poll(self, handle: Any) -> WriteStatus:
        if handle is None:
            return WriteStatus.FAILED
        # Mooncake offers only a waiting status call for batches; it runs on the transfer thread.
        return WriteStatus.DONE if self._te.get_batch_transfer_status([handle]) == 0 else WriteStatus.FAILED

    def release(self, handle: Any) -> None:
        pass  # batch status was already collected by poll(), which waits for the batch

    def close(self) -> None:
        for ptr in self._registered:
            self._te.unregister_memory(ptr)
        self._registered.clear()
