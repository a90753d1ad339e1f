"""The few CUDA driver calls the cuda_ipc backend makes, through ctypes (no torch, no runtime).

Kept apart from transfer/cuda_ipc.py so that the backend reads as what it does with the
driver (export, map, copy) and this file as how one call is made: every return code checked,
every error naming the call.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from transfer.backend import BackendError
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

FIX = "use transfer.backend mooncake or nixl"


class IpcHandle(ctypes.Structure):
    # c_ubyte, not c_char: a c_char field reads and writes only up to its first NUL byte.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def of(cls, blob: bytes) -> IpcHandle:
        return cls.from_buffer_copy(blob)


def boot_id() -> bytes:
    """16 bytes that differ between hosts (and between boots of one host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        return os.uname().nodename.encode()[:16].ljust(16, b"\0")


class Driver:
    """libcuda, loaded once per backend; every return code checked, errors name the call."""

    def __init__(self, path: str) -> None:
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise TransferConfigError(
                f"transfer.backend is cuda_ipc but the CUDA driver ({path}) cannot be loaded "
                f"({e}); CUDA IPC needs a GPU and its driver on this host: run the worker on a "
                f"GPU (parallel.device: cuda) or {FIX}"
            ) from None
        rc = self._lib.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise TransferConfigError(
                f"transfer.backend is cuda_ipc but cuInit failed ({self.error_name(rc)}): no "
                f"usable CUDA device here; run the worker on a GPU or {FIX}")

    def fn(self, *names: str) -> Any:
        """The first exported symbol of `names` (the _v2 ABI first, where the header maps to it)."""
        for name in names:
            f = getattr(self._lib, name, None)
            if f is not None:
                return f
        raise BackendError(
            f"cuda_ipc: the CUDA driver exports none of {names}; update the NVIDIA driver")

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(rc, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return f"{name.value.decode()} ({rc})"
        return f"CUresult {rc}"

    def check(self, call: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise BackendError(f"cuda_ipc: {call} failed: {self.error_name(rc)}")

    def pointer_attr(self, attr: int, ptr: int, ctype: type[Any]) -> tuple[int, Any]:
        """(return code, value) of cuPointerGetAttribute; the caller decides what failing means."""
        out = ctype()
        rc = self._lib.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(attr),
                                             ctypes.c_uint64(ptr))
        return rc, out.value

    def device_handle(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self.check(f"cuDeviceGet({ordinal})", self.fn("cuDeviceGet")(ctypes.byref(dev), ordinal))
        return dev

    def uuid(self, ordinal: int) -> bytes:
        out = (ctypes.c_ubyte * 16)()
        self.check(f"cuDeviceGetUuid({ordinal})", self.fn("cuDeviceGetUuid_v2", "cuDeviceGetUuid")(
            out, self.device_handle(ordinal)))
        return bytes(out)

    def new_event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        self.check("cuEventCreate",
                   self.fn("cuEventCreate")(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING))
        return ev

    def destroy_event(self, event: int) -> int:
        """The return code: release() after a sticky error must not raise on it."""
        return int(self.fn("cuEventDestroy_v2", "cuEventDestroy")(ctypes.c_void_p(event)))

    def memcpy(self, dst: int, src: int, n: int, stream: ctypes.c_void_p, what: str) -> None:
        self.check(f"cuMemcpyAsync(0x{dst:x} <- 0x{src:x}, {n}) {what}", self.fn("cuMemcpyAsync")(
            ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(n), stream))
