"""CUDA IPC backend: prefill maps decode's KV pool and copies device to device.

For prefill and decode on one host (the same GPU, or GPUs with peer access), no network
stack is needed: decode exports an IPC handle of the allocation that holds its KV pool,
prefill opens it once per peer (`cuIpcOpenMemHandle`) and writes every batch of spans on a
stream of its own; an event recorded after the batch is what `poll` queries. Across hosts use
mooncake or nixl.

How a batch moves (`CopyPath`): by default one gather kernel (transfer/page_gather.py) moves
every 16-byte-aligned span of the batch in one launch, with the SMs, so a room's scattered pages
(or the head slices of heterogeneous TP) move at the device's copy rate; over NVLink the stores
land in the peer GPU's pool. Spans the kernel cannot take (unaligned, or from the pinned host
scratch of the fault drill) and every span under `CopyPath.MEMCPY` go one `cuMemcpyAsync` each
— the reference path, and the fallback where triton is missing.

What the registration carries (`agent_metadata`) and how a mapped peer pool translates
addresses: transfer/cuda_peer.py.

Ordering. Prefill must not ship a page before the forward that wrote it has run on the GPU.
The engine enqueues its forward on the default (legacy) stream and hands pages to the
transfer thread after that; `submit` records an event on the legacy stream and makes the copy
stream wait for it, so the copies start only after every kernel enqueued before them — on any
thread of this process — has finished. Decode must not read a page before the copy landed:
`poll` reports DONE only once the event after the batch has completed, and only then
does the sender tell decode the room succeeded.

The driver API is used through ctypes (transfer/cuda_driver.py): no CUDA runtime library to
find, and no torch unless the gather kernel is built. Every call's return code is checked and
errors name the call.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus
from transfer.config import TransferConfigError
from transfer.cuda_driver import (
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    CU_MEMHOSTREGISTER_PORTABLE,
    CU_MEMORYTYPE_DEVICE,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    CU_STREAM_LEGACY,
    CU_STREAM_NON_BLOCKING,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_SUCCESS,
    FIX,
    LIBCUDA,
    Driver,
    IpcHandle,
    boot_id,
)
from transfer.cuda_peer import PROCESS_TOKEN, PeerPool, PoolExport

log = logging.getLogger(__name__)


class CopyPath(enum.Enum):
    """How a batch of spans is copied."""

    KERNEL = "kernel"  # one gather kernel per batch; the spans it cannot take by cuMemcpyAsync
    MEMCPY = "memcpy"  # one cuMemcpyAsync per span: the reference, and the path without triton


def kernel_available() -> bool:
    """Whether the gather kernel can be built here (torch and triton importable)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "triton"))


@dataclass
class _Batch:
    """One submitted batch: the event recorded after its last copy."""

    peer: str
    event: int
    done: bool = False
    error: str = ""
    keep: Any = None  # the gather kernel's work table (host + device): alive until released


class CudaIpcBackend(TransferBackend):
    name = "cuda_ipc"
    # No cutting before submit: the gather kernel cuts its own pieces, and the copy engine
    # needs none.
    max_range_bytes = 1 << 48

    def __init__(self, agent_label: str, *, libcuda: str = LIBCUDA,
                 copy_path: CopyPath | None = None) -> None:
        """`copy_path` None: the gather kernel where torch and triton are importable, else
        one cuMemcpyAsync per span."""
        self._name = agent_label
        self._cu = Driver(libcuda)
        if copy_path is None:
            copy_path = CopyPath.KERNEL if kernel_available() else CopyPath.MEMCPY
        elif copy_path is CopyPath.KERNEL and not kernel_available():
            raise TransferConfigError("cuda_ipc: the gather kernel needs torch and triton; "
                                      "install triton or use CopyPath.MEMCPY")
        self.copy_path = copy_path
        # connect/forget run on bootstrap threads, submit on the transfer thread
        self._lock = threading.RLock()
        self._ctx = ctypes.c_void_p()  # primary context of the pool's device (first register)
        self._device = ctypes.c_int(-1)  # its CUdevice handle
        self._ordinal = -1
        self._stream = ctypes.c_void_p()
        self._gather: Any = None  # transfer.page_gather.PageGather, built with the stream
        self._export: PoolExport | None = None
        self._local: list[tuple[int, int]] = []  # regions we copy from: the pool, pinned scratch
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
            raise BackendError("cuda_ipc: no KV pool registered yet; register(ptr, nbytes) the "
                               "device pool first")
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
                        f"transfer.backend is cuda_ipc but the KV pool at 0x{ptr:x} is host "
                        f"memory; CUDA IPC maps GPU memory only: run the worker on a GPU "
                        f"(parallel.device: cuda) or {FIX}")
                self._export = self._export_pool(ptr, nbytes)
                self._open_stream()
            elif on_device:
                raise BackendError("cuda_ipc: one device region (the KV pool) per backend; "
                                   f"0x{ptr:x} would be a second one")
            else:
                self._set_context()
                self._cu.check(f"cuMemHostRegister(0x{ptr:x}, {nbytes})",
                               self._cu.fn("cuMemHostRegister_v2", "cuMemHostRegister")(
                                   ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                                   CU_MEMHOSTREGISTER_PORTABLE))
                self._pinned.append(ptr)
            self._local.append((ptr, nbytes))

    def _open_stream(self) -> None:
        """The copy stream, and the gather kernel on it (compiled now, not at the first room)."""
        cu = self._cu
        cu.check("cuStreamCreate",
                 cu.fn("cuStreamCreate")(ctypes.byref(self._stream), CU_STREAM_NON_BLOCKING))
        if self.copy_path is CopyPath.KERNEL:
            from transfer.page_gather import PageGather

            self._gather = PageGather(self._ordinal, self._stream.value or 0)
            self._set_context()  # torch may have left another device's context current
        log.info("cuda_ipc: pool on GPU %d, copies by %s", self._ordinal, self.copy_path.value)

    def _is_device(self, ptr: int) -> bool:
        rc, kind = self._cu.pointer_attr(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr, ctypes.c_uint)
        if rc == CUDA_ERROR_INVALID_CONTEXT:  # no context on this thread: any one resolves UVA
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
        rc, capable = cu.pointer_attr(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr,
                                      ctypes.c_int)
        cu.check(f"cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE, 0x{ptr:x})", rc)
        if not capable:
            raise TransferConfigError(
                f"transfer.backend is cuda_ipc but the KV pool at 0x{ptr:x} is not in cuMemAlloc "
                "memory (virtual memory management or managed memory cannot be exported this "
                "way); unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the worker, or "
                + FIX)
        rc, base = cu.pointer_attr(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr, ctypes.c_uint64)
        cu.check(f"cuPointerGetAttribute(RANGE_START_ADDR, 0x{ptr:x})", rc)
        rc, size = cu.pointer_attr(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr, ctypes.c_uint64)
        cu.check(f"cuPointerGetAttribute(RANGE_SIZE, 0x{ptr:x})", rc)
        if ptr + nbytes > base + size:
            raise BackendError(f"cuda_ipc: [0x{ptr:x}, +{nbytes}) runs past its allocation "
                               f"[0x{base:x}, +{size}); register one tensor's memory")
        # The caching allocator may have placed the pool inside a larger segment: the handle
        # maps the whole allocation, and the peer adds the offset.
        handle = IpcHandle()
        cu.check(f"cuIpcGetMemHandle(0x{base:x})",
                 cu.fn("cuIpcGetMemHandle")(ctypes.byref(handle), ctypes.c_uint64(base)))
        return PoolExport(boot_id(), os.getpid(), PROCESS_TOKEN, cu.uuid(self._ordinal),
                          bytes(handle), ptr, nbytes, ptr - base)

    def _use_primary_context(self, ordinal: int) -> None:
        """Retain the pool GPU's primary context (the one torch's runtime uses), make it current."""
        dev = self._cu.device_handle(ordinal)
        self._cu.check(f"cuDevicePrimaryCtxRetain({ordinal})",
                       self._cu.fn("cuDevicePrimaryCtxRetain")(ctypes.byref(self._ctx), dev))
        self._device, self._ordinal = dev, ordinal
        self._set_context()

    def _borrow_context(self) -> None:
        """GPU 0's primary context, current on this thread, only to look a pointer up."""
        ctx, dev = ctypes.c_void_p(), self._cu.device_handle(0)
        fn = self._cu.fn
        self._cu.check("cuDevicePrimaryCtxRetain(0)",
                       fn("cuDevicePrimaryCtxRetain")(ctypes.byref(ctx), dev))
        self._cu.check("cuCtxSetCurrent", fn("cuCtxSetCurrent")(ctx))
        self._cu.check("cuDevicePrimaryCtxRelease(0)",  # the pool's context is retained next
                       fn("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")(dev))

    def _set_context(self) -> None:
        """Driver calls act on the calling thread's current context: make it ours (cheap)."""
        self._cu.check("cuCtxSetCurrent", self._cu.fn("cuCtxSetCurrent")(self._ctx))

    # ---- peers -----------------------------------------------------------------------------

    def connect(self, agent_name: str, metadata: bytes) -> None:
        with self._lock:
            if agent_name in self._peers:
                return
            if not self._ctx:
                raise BackendError("cuda_ipc: register the local KV pool before connecting to "
                                   "peers")
            peer = PoolExport.unpack(agent_name, metadata)
            if peer.boot_id != boot_id():
                raise BackendError(f"cuda_ipc: peer {agent_name!r} runs on another host; CUDA IPC "
                                   f"reaches only processes on this host: {FIX} between hosts")
            self._set_context()
            if peer.pid == os.getpid() and peer.process_token == PROCESS_TOKEN:
                # This very process (both roles in one process, as in tests): the pointer is ours
                # already, and a process cannot open its own IPC handle.
                self._peers[agent_name] = PeerPool(agent_name, peer.ptr, peer.nbytes, peer.ptr, 0)
                return
            self._check_reachable(agent_name, peer.device_uuid)
            mapped = ctypes.c_uint64()
            open_ = self._cu.fn("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
            open_.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
            self._cu.check(f"cuIpcOpenMemHandle (peer {agent_name!r}, pid {peer.pid})",
                           open_(ctypes.byref(mapped), IpcHandle.of(peer.ipc_handle),
                                 CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
            self._peers[agent_name] = PeerPool(agent_name, peer.ptr, peer.nbytes,
                                               mapped.value + peer.offset, mapped.value)

    def _check_reachable(self, agent: str, uuid: bytes) -> None:
        """The peer's GPU must be ours, or visible here with peer access to ours."""
        cu = self._cu
        if uuid == cu.uuid(self._ordinal):
            return
        count = ctypes.c_int()
        cu.check("cuDeviceGetCount", cu.fn("cuDeviceGetCount")(ctypes.byref(count)))
        theirs = next((d for d in range(count.value) if cu.uuid(d) == uuid), None)
        if theirs is None:
            raise BackendError(
                f"cuda_ipc: peer {agent!r} uses a GPU this process cannot see (uuid "
                f"{uuid.hex()}); give both workers the GPUs they share in CUDA_VISIBLE_DEVICES, "
                "or " + FIX)
        ok = ctypes.c_int()
        cu.check("cuDeviceCanAccessPeer", cu.fn("cuDeviceCanAccessPeer")(
            ctypes.byref(ok), self._device, cu.device_handle(theirs)))
        if not ok.value:
            raise BackendError(
                f"cuda_ipc: GPU {self._ordinal} has no peer access to GPU {theirs} (peer "
                f"{agent!r}); put both workers on one GPU, or NVLink-/PCIe-peered GPUs, or {FIX}")

    def forget(self, agent_name: str) -> None:
        with self._lock:
            peer = self._peers.pop(agent_name, None)
            if peer is None or not peer.opened:
                return
            self._set_context()
            if self._stream:  # no copy into the mapping may still be running when it goes away
                self._cu.check("cuStreamSynchronize",
                               self._cu.fn("cuStreamSynchronize")(self._stream))
            self._cu.check(f"cuIpcCloseMemHandle (peer {agent_name!r})",
                           self._cu.fn("cuIpcCloseMemHandle")(ctypes.c_uint64(peer.opened)))

    # ---- writes ----------------------------------------------------------------------------

    def submit(self, peer: str, spans: list[Span]) -> Any:
        cu = self._cu
        with self._lock:
            pool = self._peers.get(peer)
            if pool is None:
                raise BackendError(f"cuda_ipc: peer {peer!r} is not connected (never registered, "
                                   "or forgotten)")
            table = np.array(spans, dtype=np.int64).reshape(-1, 3)  # [N, 3] src, dst, bytes
            self._check_spans(pool, table)
            table[:, 1] += pool.local_ptr - pool.ptr  # the peer's addresses → ours
            self._set_context()
            # Ordering: the copies wait for everything already enqueued on the default stream —
            # the forward that wrote these pages (see the module docstring).
            ready = cu.new_event()
            try:
                cu.check("cuEventRecord(legacy stream)",
                         cu.fn("cuEventRecord")(ready, ctypes.c_void_p(CU_STREAM_LEGACY)))
                cu.check("cuStreamWaitEvent", cu.fn("cuStreamWaitEvent")(self._stream, ready, 0))
            finally:
                cu.check("cuEventDestroy", cu.destroy_event(ready.value or 0))  # freed once fired
            keep, rest = self._launch_gather(pool, table)
            for src, dst, n in rest.tolist():
                cu.memcpy(dst, src, n, self._stream, f"to peer {peer!r}")
            done = cu.new_event()
            cu.check("cuEventRecord(copy stream)", cu.fn("cuEventRecord")(done, self._stream))
            self._in_flight.add(done.value or 0)
            return _Batch(peer, done.value or 0, keep=keep)

    def _launch_gather(self, pool: PeerPool, table: np.ndarray) -> tuple[Any, np.ndarray]:
        """The kernel's share of a batch (our addresses on both sides), launched; returns what
        it must keep alive and the spans left to cuMemcpyAsync."""
        if self._gather is None or self._export is None or not table.shape[0]:
            return None, table
        from transfer.page_gather import eligible

        src, n = table[:, 0], table[:, 2]
        ours = self._export
        on_kernel = eligible(table) & (src >= ours.ptr) & (src + n <= ours.ptr + ours.nbytes)
        if not on_kernel.any():
            return None, table
        keep = self._gather.launch(ours.ptr, pool.local_ptr, table[on_kernel])
        self._set_context()  # torch's launch may leave another context current on this thread
        return keep, table[~on_kernel]

    def _check_spans(self, pool: PeerPool, table: np.ndarray) -> None:
        """Every span inside the peer's pool and inside one local region; the first one that is
        not is refused with the per-span message."""
        src, n = table[:, 0], table[:, 2]
        local = np.zeros(table.shape[0], dtype=bool)
        for p, size in self._local:
            local |= (src >= p) & (src + n <= p + size)
        bad = ~(pool.inside(table) & local)
        if bad.any():
            s, d, length = (int(v) for v in table[int(np.argmax(bad))])
            pool.translate(d, length)
            raise BackendError(f"cuda_ipc: source range 0x{s:x}+{length} is outside every "
                               "registered region")

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
            raise BackendError(f"cuda_ipc: copies to peer {batch.peer!r} failed: cuEventQuery "
                               f"returned {batch.error}")
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
            if batch.error:  # the context holds a sticky error: every call fails now, poll said why
                self._cu.destroy_event(batch.event)
                batch.keep = None
                return
            if not batch.done:
                self._cu.check("cuEventSynchronize",
                               self._cu.fn("cuEventSynchronize")(ctypes.c_void_p(batch.event)))
            batch.keep = None  # the kernel has read its work table
            self._cu.check("cuEventDestroy", self._cu.destroy_event(batch.event))

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
                cu.destroy_event(event)
            self._in_flight.clear()
            for ptr in self._pinned:
                cu.check(f"cuMemHostUnregister(0x{ptr:x})",
                         cu.fn("cuMemHostUnregister")(ctypes.c_void_p(ptr)))
            self._pinned.clear()
            self._gather = None
            if self._stream:
                cu.check("cuStreamDestroy",
                         cu.fn("cuStreamDestroy_v2", "cuStreamDestroy")(self._stream))
                self._stream = ctypes.c_void_p()
            cu.check("cuDevicePrimaryCtxRelease",
                     cu.fn("cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease")(
                         self._device))
            self._ctx = ctypes.c_void_p()
