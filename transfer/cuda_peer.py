"""A peer's KV pool for the cuda_ipc backend: its wire form and its mapping in this process.

`PoolExport` is what `agent_metadata` carries (a fixed binary layout, never pickled): the IPC
handle of the allocation, the pool's offset inside it, the pool's address and size in the
exporter's address space, the GPU's UUID, and the host's boot id + pid + a random process
token (same host? same process?). `PeerPool` is the pool once mapped here: the peer's
addresses translate to ours by a constant shift, and nothing outside the pool is reachable.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass

import numpy as np

from transfer.backend import BackendError

# agent_metadata: magic, version, boot id, pid, process token, GPU uuid, IPC handle,
# pool address (peer's address space), pool bytes, pool offset inside the allocation
_META = struct.Struct("<8sH16sI8s16s64sQQQ")
_MAGIC = b"TNDMCIPC"
_VERSION = 1
PROCESS_TOKEN = secrets.token_bytes(8)  # with the pid: is the peer this very process?


@dataclass(frozen=True)
class PoolExport:
    """What a peer needs to map this rank's KV pool (the wire form of agent_metadata)."""

    boot_id: bytes
    pid: int
    process_token: bytes
    device_uuid: bytes
    ipc_handle: bytes
    ptr: int  # the pool's address in the exporter's address space
    nbytes: int
    offset: int  # ptr - base of the allocation the handle maps

    def pack(self) -> bytes:
        return _META.pack(_MAGIC, _VERSION, self.boot_id, self.pid, self.process_token,
                          self.device_uuid, self.ipc_handle, self.ptr, self.nbytes, self.offset)

    @classmethod
    def unpack(cls, agent: str, blob: bytes) -> PoolExport:
        if len(blob) != _META.size:
            raise BackendError(
                f"cuda_ipc: metadata of peer {agent!r} is {len(blob)} bytes, expected "
                f"{_META.size}; both sides must run transfer.backend cuda_ipc of the same version")
        magic, version, boot, pid, token, uuid, handle, ptr, nbytes, offset = _META.unpack(blob)
        if magic != _MAGIC or version != _VERSION:
            raise BackendError(
                f"cuda_ipc: metadata of peer {agent!r} is not cuda_ipc version {_VERSION} "
                f"(magic {magic!r}, version {version}); both sides must run the same backend")
        if offset > ptr or nbytes == 0:
            raise BackendError(f"cuda_ipc: metadata of peer {agent!r} is inconsistent (offset "
                               f"{offset}, ptr 0x{ptr:x}, nbytes {nbytes})")
        return cls(boot, pid, token, uuid, handle, ptr, nbytes, offset)


@dataclass(frozen=True)
class PeerPool:
    """A peer's pool as mapped here: its addresses translate to ours by a constant shift."""

    agent: str
    ptr: int  # the pool's address in the peer's address space
    nbytes: int
    local_ptr: int  # the same bytes in our address space
    opened: int  # what cuIpcOpenMemHandle returned (to close), 0 when the peer is this process

    def translate(self, dst: int, length: int) -> int:
        """Our address of the peer's [dst, dst+length); refuses anything outside its pool."""
        if length <= 0 or dst < self.ptr or dst + length > self.ptr + self.nbytes:
            raise BackendError(
                f"cuda_ipc: range 0x{dst:x}+{length} is outside the pool peer {self.agent!r} "
                f"registered (0x{self.ptr:x}+{self.nbytes})")
        return self.local_ptr + (dst - self.ptr)

    def inside(self, spans: np.ndarray) -> np.ndarray:
        """[N, 3] (src, dst, bytes) → [N] bool: dst ranges non-empty and inside the pool."""
        dst, n = spans[:, 1], spans[:, 2]
        return (n > 0) & (dst >= self.ptr) & (dst + n <= self.ptr + self.nbytes)
