"""CUDA IPC backend: prefill maps decode's KV pool and copies device to device.

For prefill and decode on one host (the same GPU, or GPUs with peer access), no network
stack is needed: decode exports an IPC handle of the allocation that holds its KV pool,
prefill opens it once per peer (`cuIpcOpenMemHandle`) and writes every span with
`cuMemcpyAsync` on a stream of its own; an event recorded after the last copy is what
`poll` queries. Across hosts use mooncake or nixl.

What the registration carries (`agent_metadata`, fixed binary layout, never pickled):
the IPC handle of the allocation, the pool's offset inside it, the pool's address and size in
the peer's address space, the GPU's UUID, and the host's boot id + pid + a random process
token (same host? same process?).

Ordering. Prefill must not ship a page before the forward that wrote it has run on the GPU.
The engine enqueues its forward on the default (legacy) stream and hands pages to the
transfer thread after that; `submit` records an event on the legacy stream and makes the copy
stream wait for it, so the copies start only after every kernel enqueued before them — on any
thread of this process — has finished. Decode must not read a page before the copy landed:
`poll` reports DONE only once the event after the last copy has completed, and only then
does the sender tell decode the room succeeded.

Only the CUDA driver API is used (libcuda through ctypes): no torch here, and no CUDA
runtime library to find. Every call's return code is checked and errors name the call.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus
from transfer.config import TransferConfigError

LIBCUDA = "libcuda.so.1"

# cuda.h values used here
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_READY = 600
CU_POINTER_ATTRIBUTE_CONTEXT = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
CU_MEMORYTYPE_DEVICE = 2
CU_STREAM_LEGACY = 0x1  # the legacy default stream (torch's default stream)
CU_STREAM_NON_BLOCKING = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
IPC_HANDLE_BYTES = 64

# agent_metadata: magic, version, boot id, pid, process token, GPU uuid, IPC handle,
# pool address (peer's address space), pool bytes, pool offset inside the allocation
_META = struct.Struct("<8sH16sI8s16s64sQQQ")
_MAGIC = b"TNDMCIPC"
_VERSION = 1
_PROCESS_TOKEN = secrets.token_bytes(8)  # with the pid: is the peer this very process?

_FIX = "use transfer.backend mooncake or nixl"


class _IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char field reads and writes only up to its first NUL byte.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def of(cls, blob: bytes) -> _IpcHandle:
        return cls.from_buffer_copy(blob)


def _boot_id() -> bytes:
    """16 bytes that differ between hosts (and between boots of one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        return os.uname().nodename.encode()[:16].ljust(16, b"\0")


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
        return _META.pack(_MAGIC, _VERSION, self.boot_id, self.pid, self.process_token, self.device_uuid,
                          self.ipc_handle, self.ptr, self.nbytes, self.offset)

    @classmethod
    def unpack(cls, agent: str, blob: bytes) -> PoolExport:
        if len(blob) != _META.size:
            raise BackendError(f"cuda_ipc: metadata of peer {agent!r} is {len(blob)} bytes, expected {_META.size}; "
                               "both sides must run transfer.backend cuda_ipc of the same version")
        magic, version, boot, pid, token, uuid, handle, ptr, nbytes, offset = _META.unpack(blob)
        if magic != _MAGIC or version != _VERSION:
            raise BackendError(f"cuda_ipc: metadata of peer {agent!r} is not cuda_ipc version {_VERSION} "
                               f"(magic {magic!r}, version {version}); both sides must run the same backend")
        if offset > ptr or nbytes == 0:
            raise BackendError(f"cuda_ipc: metadata of peer {agent!r} is inconsistent (offset {offset}, ptr 0x{ptr:x}, "
                               f"nbytes {nbytes})")
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
            raise BackendError(f"cuda_ipc: range 0x{dst:x}+{length} is outside the pool peer {self.agent!r} registered "
                               f"(0x{self.ptr:x}+{self.nbytes})")
        return self.local_ptr + (dst - self.ptr)


@dataclass
class _Batch:
    """One submitted batch: the event recorded after its last copy."""

    peer: str
    event: int
    done: bool = False
    error: str = ""


class _Driver:
    """The few libcuda calls this backend makes; every return code checked, errors name the call."""

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise TransferConfigError(
                f"transfer.backend is cuda_ipc but the CUDA driver ({path}) cannot be loaded ({e}); CUDA IPC needs a "
                f"GPU and its driver on this host: run the worker on a GPU (parallel.device: cuda) or {_FIX}"
            ) from None
        rc = self._lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise TransferConfigError(f"transfer.backend is cuda_ipc but cuInit failed ({self.error_name(rc)}): no usable "
                                      f"CUDA device here; run the worker on a GPU or {_FIX}")

    def fn(self, *names: str) -> Any:
        """The first exported symbol of `names` (the _v2 ABI first, where the header maps to it)."""
        for name in names:
            f = getattr(self._lib, name, None)
            if f is not None:
                return f
        raise BackendError(f"cuda_ipc: the CUDA driver exports none of {names}; update the NVIDIA driver")

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(rc, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return f"{name.value.decode()} ({rc})"
        return f"CUresult {rc}"

    def check(self, call: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise BackendError(f"cuda_ipc: {call} failed: {self.error_name(rc)}")

    def pointer_attr(self, attr: int, ptr: int, ctype: type[Any]) -> tuple[int, Any]:
        """(return code, value) of cuPointerGetAttribute: the caller decides what a failure means."""
        out = ctype()
        rc = self._lib.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(attr), ctypes.c_uint64(ptr))
        return rc, out.value


class CudaIpcBackend(TransferBackend):
    name = "cuda_ipc"
    # One cuMemcpyAsync per range: the copy engine needs no cutting.
    max_range_bytes = 1 << 48

    def __init__(self, agent_label: str, *, libcuda: str = LIBCUDA) -> None:
        self._name = agent_label
        self._cu = _Driver(libcuda)
        self._lock = threading.RLock()  # connect/forget run on bootstrap threads, submit on the transfer thread
        self._ctx = ctypes.c_void_p()  # primary context of the pool's device (set by the first register)
        self._device = ctypes.c_int(-1)  # its CUdevice handle
        self._ordinal = -1
        self._stream = ctypes.c_void_p()
        self._export: PoolExport | None = None
        self._local: list[tuple[int, int]] = []  # regions we copy from: the pool, pinned host scratch
        self._pinned: list[int] = []  # host regions registered with cuMemHostRegister
        self._peers: dict[str, PeerPool] = {}
        self._in_flight: set[int] = set()  # events of batches not yet released
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def agent_metadata(self) -> bytes:
        if self._export is None:
            raise BackendError("cuda_ipc: no KV pool registered yet; register(ptr, nbytes) the device pool first")
        return self._export.pack()

    # ---- memory ----------------------------------------------------------------------------

    def register(self, ptr: int, nbytes: int) -> None:
        """The first region is the KV pool and must be CUDA device memory (it is what peers map).
        Later host regions (the manager's fault-drill scratch) are pinned as local copy sources."""
        with self._lock:
            on_device = self._is_device(ptr)
            if self._export is None:
                if not on_device:
                    raise TransferConfigError(
                        f"transfer.backend is cuda_ipc but the KV pool at 0x{ptr:x} is host memory; CUDA IPC maps GPU "
                        f"memory only: run the worker on a GPU (parallel.device: cuda) or {_FIX}")
                self._export = self._export_pool(ptr, nbytes)
            elif on_device:
                raise BackendError("cuda_ipc: one device region (the KV pool) per backend; "
                                   f"0x{ptr:x} would be a second one")
            else:
                self._set_context()
                self._cu.check(f"cuMemHostRegister(0x{ptr:x}, {nbytes})",
                               self._cu.fn("cuMemHostRegister_v2", "cuMemHostRegister")(
                                   ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE))
                self._pinned.append(ptr)
            self._local.append((ptr, nbytes))

    def _is_device(self, ptr: int) -> bool:
        rc, kind = self._cu.pointer_attr(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr, ctypes.c_uint)
        if rc == CUDA_ERROR_INVALID_CONTEXT:  # this thread has no context yet: any one resolves a UVA pointer
            self._borrow_context()
            rc, kind = self._cu.pointer_attr(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr, ctypes.c_uint)
        if rc == CUDA_ERROR_INVALID_VALUE:  # memory CUDA has never seen: plain host memory
            return False
        self._cu.check(f"cuPointerGetAttribute(MEMORY_TYPE, 0x{ptr:x})", rc)
        return bool(kind == CU_MEMORYTYPE_DEVICE)

    def _export_pool(self, ptr: int, nbytes: int) -> PoolExport:
        cu = self._cu
        rc, ordinal = cu.pointer_attr(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr, ctypes.c_int)
        cu.check(f"cuPointerGetAttribute(DEVICE_ORDINAL, 0x{ptr:x})", rc)
        self._use_primary_context(ordinal)
        rc, capable = cu.pointer_attr(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr, ctypes.c_int)
        cu.check(f"cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE, 0x{ptr:x})", rc)
        if not capable:
            raise TransferConfigError(
                f"transfer.backend is cuda_ipc but the KV pool at 0x{ptr:x} is not in cuMemAlloc memory (virtual memory "
                "management or managed memory cannot be exported this way); unset "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the worker, or " + _FIX)
        rc, base = cu.pointer_attr(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr, ctypes.c_uint64)
        cu.check(f"cuPointerGetAttribute(RANGE_START_ADDR, 0x{ptr:x})", rc)
        rc, size = cu.pointer_attr(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr, ctypes.c_uint64)
        cu.check(f"cuPointerGetAttribute(RANGE_SIZE, 0x{ptr:x})", rc)
        if ptr + nbytes > base + size:
            raise BackendError(f"cuda_ipc: [0x{ptr:x}, +{nbytes}) runs past its allocation [0x{base:x}, +{size}); "
                               "register one tensor's memory")
        # The caching allocator may have placed the pool inside a larger segment: the handle
        # maps the whole allocation, and the peer adds the offset.
        handle = _IpcHandle()
        cu.check(f"cuIpcGetMemHandle(0x{base:x})", cu.fn("cuIpcGetMemHandle")(ctypes.byref(handle), ctypes.c_uint64(base)))
        return PoolExport(_boot_id(), os.getpid(), _PROCESS_TOKEN, self._uuid(self._ordinal),
                          bytes(handle), ptr, nbytes, ptr - base)

    def _use_primary_context(self, ordinal: int) -> None:
        """Retain the primary context of the pool's GPU (the one torch's runtime uses) and make it current."""
        dev = self._device_handle(ordinal)
        self._cu.check(f"cuDevicePrimaryCtxRetain({ordinal})",
                       self._cu.fn("cuDevicePrimaryCtxRetain")(ctypes.byref(self._ctx), dev))
        self._device, self._ordinal = dev, ordinal
        self._set_context()

    def _borrow_context(self) -> None:
        """GPU 0's primary context, current on this thread, only to look a pointer up."""
        ctx, dev = ctypes.c_void_p(), self._device_handle(0)
        self._cu.check("cuDevicePrimaryCtxRetain(0)", self._cu.fn("cuDevicePrimaryCtxRetain")(ctypes.byref(ctx), dev))
        self._cu.check("cuCtxSetCurrent", self._cu.fn("cuCtxSetCurrent")(ctx))
        self._cu.check("cuDevicePrimaryCtxRelease(0)",  # the pool's context is retained right after
                       self._cu.fn("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")(dev))

    def _device_handle(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self._cu.check(f"cuDeviceGet({ordinal})", self._cu.fn("cuDeviceGet")(ctypes.byref(dev), ordinal))
        return dev

    def _set_context(self) -> None:
        """Driver calls act on the calling thread's current context: make it ours (cheap)."""
        self._cu.check("cuCtxSetCurrent", self._cu.fn("cuCtxSetCurrent")(self._ctx))

    def _uuid(self, ordinal: int) -> bytes:
        out = (ctypes.c_ubyte * 16)()
        self._cu.check(f"cuDeviceGetUuid({ordinal})",
                       self._cu.fn("cuDeviceGetUuid_v2", "cuDeviceGetUuid")(out, self._device_handle(ordinal)))
        return bytes(out)

    # ---- peers -----------------------------------------------------------------------------

    def connect(self, agent_name: str, metadata: bytes) -> None:
        with self._lock:
            if agent_name in self._peers:
                return
            if not self._ctx:
                raise BackendError("cuda_ipc: register the local KV pool before connecting to peers")
            peer = PoolExport.unpack(agent_name, metadata)
            if peer.boot_id != _boot_id():
                raise BackendError(f"cuda_ipc: peer {agent_name!r} runs on another host; CUDA IPC reaches only "
                                   f"processes on this host: {_FIX} between hosts")
            self._set_context()
            if peer.pid == os.getpid() and peer.process_token == _PROCESS_TOKEN:
                # This very process (both roles in one process, as in tests): the pointer is ours
                # already, and a process cannot open its own IPC handle.
                self._peers[agent_name] = PeerPool(agent_name, peer.ptr, peer.nbytes, peer.ptr, 0)
                return
            self._check_reachable(agent_name, peer.device_uuid)
            mapped = ctypes.c_uint64()
            handle = _IpcHandle.of(peer.ipc_handle)
            open_ = self._cu.fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
            open_.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
            self._cu.check(f"cuIpcOpenMemHandle (peer {agent_name!r}, pid {peer.pid})",
                           open_(ctypes.byref(mapped), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
            self._peers[agent_name] = PeerPool(agent_name, peer.ptr, peer.nbytes, mapped.value + peer.offset, mapped.value)

    def _check_reachable(self, agent: str, uuid: bytes) -> None:
        """The peer's GPU must be ours, or visible here with peer access to ours."""
        if uuid == self._uuid(self._ordinal):
            return
        count = ctypes.c_int()
        self._cu.check("cuDeviceGetCount", self._cu.fn("cuDeviceGetCount")(ctypes.byref(count)))
        theirs = next((d for d in range(count.value) if self._uuid(d) == uuid), None)
        if theirs is None:
            raise BackendError(f"cuda_ipc: peer {agent!r} uses a GPU this process cannot see (uuid {uuid.hex()}); "
                               "give both workers the GPUs they share in CUDA_VISIBLE_DEVICES, or " + _FIX)
        ok = ctypes.c_int()
        self._cu.check("cuDeviceCanAccessPeer", self._cu.fn("cuDeviceCanAccessPeer")(
            ctypes.byref(ok), self._device, self._device_handle(theirs)))
        if not ok.value:
            raise BackendError(f"cuda_ipc: GPU {self._ordinal} has no peer access to GPU {theirs} (peer "
                               f"{agent!r}); put both workers on one GPU, or NVLink-/PCIe-peered GPUs, or {_FIX}")

    def forget(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
            if peer is None or not peer.opened:
                return
            self._set_context()
            if self._stream:  # no copy into the mapping may still be running when it goes away
                self._cu.check("cuStreamSynchronize", self._cu.fn("cuStreamSynchronize")(self._stream))
            self._cu.check(f"cuIpcCloseMemHandle (peer {agent_name!r})",
                           self._cu.fn("cuIpcCloseMemHandle")(ctypes.c_uint64(peer.opened)))

    # ---- writes ----------------------------------------------------------------------------

    def submit(self, peer: str, spans: list[Span]) -> Any:
        cu = self._cu
        with self._lock:
            pool = self._peers.get(peer)
            if pool is None:
                raise BackendError(f"cuda_ipc: peer {peer!r} is not connected (never registered, or forgotten)")
            copies = [(self._check_local(src, n), pool.translate(dst, n), n) for src, dst, n in spans]
            self._set_context()
            if not self._stream:
                cu.check("cuStreamCreate", cu.fn("cuStreamCreate")(ctypes.byref(self._stream), CU_STREAM_NON_BLOCKING))
            # Ordering: the copies wait for everything already enqueued on the default stream —
            # the forward that wrote these pages (see the module docstring).
            ready = self._new_event()
            try:
                cu.check("cuEventRecord(legacy stream)", cu.fn("cuEventRecord")(ready, ctypes.c_void_p(CU_STREAM_LEGACY)))
                cu.check("cuStreamWaitEvent", cu.fn("cuStreamWaitEvent")(self._stream, ready, 0))
            finally:
                cu.check("cuEventDestroy", cu.fn("cuEventDestroy_v2", "cuEventDestroy")(ready))  # freed once it fires
            memcpy = cu.fn("cuMemcpyAsync")
            for src, dst, n in copies:
                cu.check(f"cuMemcpyAsync(0x{dst:x} <- 0x{src:x}, {n}) to peer {peer!r}",
                         memcpy(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n), self._stream))
            done = self._new_event()
            cu.check("cuEventRecord(copy stream)", cu.fn("cuEventRecord")(done, self._stream))
            self._in_flight.add(done.value or 0)
            return _Batch(peer, done.value or 0)

    def _check_local(self, src: int, length: int) -> int:
        if not any(p <= src and src + length <= p + n for p, n in self._local):
            raise BackendError(f"cuda_ipc: source range 0x{src:x}+{length} is outside every registered region")
        return src

    def _new_event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        self._cu.check("cuEventCreate", self._cu.fn("cuEventCreate")(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING))
        return ev

    def poll(self, handle: Any) -> WriteStatus:
        batch: _Batch = handle
        if batch.done:
            return WriteStatus.DONE
        with self._lock:
            self._set_context()
            rc = self._cu.fn("cuEventQuery")(ctypes.c_void_p(batch.event))
        if rc == CUDA_ERROR_NOT_READY:
            return WriteStatus.IN_FLIGHT
        if rc != CUDA_SUCCESS:
            batch.error = self._cu.error_name(rc)
            raise BackendError(f"cuda_ipc: copies to peer {batch.peer!r} failed: cuEventQuery returned {batch.error}")
        batch.done = True
        return WriteStatus.DONE

    def release(self, handle: Any) -> None:
        """A DMA copy cannot be cancelled: wait for it, so no write lands after release returns."""
        batch: _Batch = handle
        with self._lock:
            if batch.event not in self._in_flight:
                return
            self._in_flight.discard(batch.event)
            self._set_context()
            event = ctypes.c_void_p(batch.event)
            destroy = self._cu.fn("cuEventDestroy_v2", "cuEventDestroy")
            if batch.error:  # the context holds a sticky error: every call fails now, poll said why
                destroy(event)
                return
            if not batch.done:
                self._cu.check("cuEventSynchronize", self._cu.fn("cuEventSynchronize")(event))
            self._cu.check("cuEventDestroy", destroy(event))

    def close(self) -> None:
        with self._lock:
            if self._closed or not self._ctx:
                self._closed = True
                return
            self._closed = True
            for agent in list(self._peers):
                self.forget(agent)
            cu = self._cu
            self._set_context()
            for event in list(self._in_flight):
                cu.fn("cuEventSynchronize")(ctypes.c_void_p(event))
                cu.fn("cuEventDestroy_v2", "cuEventDestroy")(ctypes.c_void_p(event))
            self._in_flight.clear()
            for ptr in self._pinned:
                cu.check(f"cuMemHostUnregister(0x{ptr:x})", cu.fn("cuMemHostUnregister")(ctypes.c_void_p(ptr)))
            self._pinned.clear()
            if self._stream:
                cu.check("cuStreamDestroy", cu.fn("cuStreamDestroy_v2", "cuStreamDestroy")(self._stream))
                self._stream = ctypes.c_void_p()
            cu.check("cuDevicePrimaryCtxRelease",
                     cu.fn("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")(self._device))
            self._ctx = ctypes.c_void_p()
