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
from dataclasses import dataclass, field
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


@dataclass
class _Batch:
    """One write: a Mooncake batch id per range, those still in flight, the first failure."""

    pending: set[int] = field(default_factory=set)
    failed: str = ""


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
        self._peers: set[str] = set()  # handshaken (connect)

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._te.register_memory(ptr, nbytes)
        if rc != 0:
            raise BackendError(f"mooncake: register_memory(0x{ptr:x}, {nbytes}) returned {rc}")
        self._registered.append(ptr)

    def connect(self, agent_name: str, metadata: bytes) -> None:
        # Handshake now, while the peer is provably alive (it just registered), with an empty
        # write: Mooncake does the P2P handshake on a peer's first write, holding a lock every
        # other write waits on, so a first write to a peer that froze would stall the writes to
        # every peer until the handshake times out (~60 s, measured).
        if agent_name in self._peers or not self._registered:
            return
        rc = self._te.transfer_sync_write(agent_name, self._registered[0], 0, 0)
        if rc != 0:
            raise BackendError(f"mooncake: handshake with {agent_name} returned {rc}")
        self._peers.add(agent_name)

    def forget(self, agent_name: str) -> None:
        self._peers.discard(agent_name)  # a restarted peer answers on its new rpc port

    def submit(self, peer: str, spans: list[Span]) -> Any:
        # One Mooncake batch per range (`transfer_submit_write`), each polled on its own with
        # `transfer_check_status` (0 in flight, 1 done, -1 failed; it frees the batch once
        # done). Never `batch_transfer_sync_write`: it blocks until the peer answers, and a
        # frozen peer answers never. `transfer_check_status` on a many-range batch looks at its
        # first task only, so the ranges are not batched together.
        batch = _Batch()
        for src, dst, n in spans:
            bid = self._te.transfer_submit_write(peer, src, dst, n)
            if bid <= 0:
                batch.failed = f"transfer_submit_write to {peer} returned {bid}"
                break
            batch.pending.add(bid)
        if batch.failed and not batch.pending:
            raise BackendError(f"mooncake: {batch.failed}")
        return batch

    def poll(self, handle: Any) -> WriteStatus:
        batch: _Batch = handle
        for bid in list(batch.pending):
            code = self._te.transfer_check_status(bid)
            if code != 0:
                batch.pending.discard(bid)
                if code < 0:
                    batch.failed = batch.failed or f"a range to the peer failed ({code})"
        if batch.pending:
            return WriteStatus.IN_FLIGHT  # even after a failure: the others may still land
        return WriteStatus.FAILED if batch.failed else WriteStatus.DONE

    def cancel(self, handle: Any) -> bool:
        return not handle.pending  # Mooncake cannot stop a range in flight

    def release(self, handle: Any) -> None:
        pass  # each batch was freed by the transfer_check_status that saw it end

    def close(self) -> None:
        for ptr in self._registered:
            self._te.unregister_memory(ptr)
        self._registered.clear()
        # Destroy the engine here, not at a random GC point: its destructor holds the GIL for
        # about a second (it joins its handshake threads), stalling every thread of the process.
        self._te = None
