"""Mooncake Transfer Engine backend: P2P handshake (no metadata server), tcp or rdma.

Mooncake reports every failure as return code -1, never an exception, so each call's code is
checked here and turned into BackendError naming the call.

Listen address: Mooncake binds its handshake daemon and TCP data port to every interface and
offers no setting for it; the worker loads transfer/bind_host.c (see transfer/bind_host.py) so
they bind the worker's host. Without it this backend says so in the log, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus
from transfer.bind_host import shim_loaded
from transfer.config import TransferConfigError

log = logging.getLogger(__name__)

# Lines Mooncake's C++ logging (glog, straight to fd 2) prints at every healthy start, which
# say nothing is wrong: with P2P handshake there is no metadata server, and initialize() looks
# its own segment up before it has published it ("Local segment descriptor not found"), then
# publishes it; glog adds a warning that it logs before InitGoogleLogging.
_BENIGN = ("Local segment descriptor not found", "Logging before InitGoogleLogging")


@contextlib.contextmanager
def _quiet_stderr(drop: tuple[str, ...]) -> Iterator[None]:
    """Catch what C++ code writes to fd 2 meanwhile; write it back without the `drop` lines
    (anything else, from any thread, is kept: only reordered after the block)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(d in ln for d in drop)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(
        self, host: str, *, protocol: str = "tcp", ib_device: str = "", bind_host: str = ""
    ) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO logs flood worker output
        from mooncake.engine import TransferEngine

        if not shim_loaded(bind_host or host):
            log.warning(
                "mooncake: its handshake and TCP listeners bind every interface, not %s: "
                "the bind-host shim is not loaded (start workers with `tandem worker`, "
                "which loads it)",
                bind_host or host,
            )

        if protocol == "rdma" and not ib_device:
            raise TransferConfigError(
                "transfer.ib_device is empty and DISAGGREGATION_IB_DEVICE is unset; "
                "rdma needs the RDMA device names (e.g. mlx5_0,mlx5_1), or use protocol tcp"
            )
        self._te: Any = TransferEngine()
        with _quiet_stderr(_BENIGN):
            rc = self._te.initialize(host, "P2PHANDSHAKE", protocol,
                                     ib_device if protocol == "rdma" else "")
        if rc != 0:
            raise BackendError(
                f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}"
            )
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
        # Mooncake's Python API has no non-blocking status for a whole batch
        # (transfer_check_status looks at task 0 only, and frees the batch when that one is
        # done), so the batch runs to completion here, on the manager's transfer thread; the
        # engine never waits on it. Mooncake bounds it itself (MC_TRANSFER_TIMEOUT, >= 5 s).
        src, dst, lengths = (list(col) for col in zip(*spans, strict=True))
        return self._te.batch_transfer_sync_write(peer, src, dst, lengths)

    def poll(self, handle: Any) -> WriteStatus:
        return WriteStatus.DONE if handle == 0 else WriteStatus.FAILED

    def release(self, handle: Any) -> None:
        pass  # submit ran the batch to completion; nothing is held

    def close(self) -> None:
        for ptr in self._registered:
            self._te.unregister_memory(ptr)
        self._registered.clear()
        # Destroy the engine here, not at a random GC point: its destructor holds the GIL for
        # about a second (it joins its handshake threads), stalling every thread of the process.
        self._te = None
