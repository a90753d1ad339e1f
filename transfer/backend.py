"""The one small interface every KV transfer backend implements, and the fault-drill settings.

A backend registers one memory region (the rank's KV pool: base pointer + size; CPU memory for
mooncake and nixl here, GPU memory for cuda_ipc), tells peers how to
reach it (`agent_name` + `agent_metadata`, carried by the bootstrap), and writes batches of
(src address, dst address, length) ranges to a peer: `submit` starts a batch and returns at
once, `poll` reports it, `cancel` stops it where the backend can, `release` frees it. The
manager calls them on its per-peer lanes (transfer/lanes.py), never on the engine's thread;
a call that blocks holds up only its own peer's lane.

The completion notice and the first token travel on the bootstrap stream (ordered after the
confirmed writes), so backends need no notification channel of their own.
"""

from __future__ import annotations

import enum
import os
import random
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from transfer.config import TransferConfigError

FAULTS_ENV = "TANDEM_TRANSFER_FAULTS"


class BackendError(RuntimeError):
    """A backend call failed (bad address, unreachable peer, write error); says which call."""


class WriteStatus(enum.Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


Span = tuple[int, int, int]  # (src address, dst address, length in bytes)


class TransferBackend(ABC):
    """Register memory, reach peers, write ranges. One instance per manager (per rank)."""

    name: str  # "mooncake" | "nixl" | "cuda_ipc"
    # Longer ranges are cut before submit: a backend moves several mid-size ranges in parallel
    # lanes but one huge range in one (NIXL/UCX loopback: 2.7 GB/s as one 576 MiB range,
    # 5.4 GB/s in 4 MiB pieces).
    max_range_bytes: int = 64 << 20

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Register [ptr, ptr+nbytes) for transfers (source on prefill, destination on decode)."""

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """How a peer addresses this agent (mooncake: "host:rpc_port"; nixl, cuda_ipc: the
        agent label)."""

    @property
    def agent_metadata(self) -> bytes:
        """Blob a peer needs before writing to us (nixl, cuda_ipc); empty where the name
        suffices."""
        return b""

    @abstractmethod
    def connect(self, agent_name: str, metadata: bytes) -> None:
        """Make `agent_name` writable from here (idempotent)."""

    @abstractmethod
    def forget(self, agent_name: str) -> None:
        """Drop what we know about a peer (it restarted or left)."""

    @abstractmethod
    def submit(self, peer: str, spans: list[Span]) -> Any:
        """Start writing `spans` to `peer`; returns a handle for poll/release."""

    @abstractmethod
    def poll(self, handle: Any) -> WriteStatus:
        """State of a submitted batch (may wait briefly where the backend only offers a wait)."""

    @abstractmethod
    def release(self, handle: Any) -> None:
        """Free the handle of a batch that ended (or that `cancel` could not stop, once over)."""

    def cancel(self, handle: Any) -> bool:
        """Stop a batch still in flight. True: nothing of it can land any more and the handle
        is free; False: this backend cannot stop it now, so the caller polls it until it ends
        (then releases it). Default: `release` stops it."""
        self.release(handle)
        return True

    def write(self, peer: str, spans: list[Span], timeout_s: float) -> None:
        """Write and wait until confirmed; BackendError on failure or after `timeout_s`."""
        if not spans:
            return
        handle = self.submit(peer, spans)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                status = self.poll(handle)
                if status is WriteStatus.DONE:
                    return
                if status is WriteStatus.FAILED:
                    raise BackendError(f"{self.name}: write of {len(spans)} ranges to {peer} "
                                       "failed")
                if time.monotonic() > deadline:
                    raise BackendError(f"{self.name}: write to {peer} not confirmed within "
                                       f"{timeout_s}s")
                time.sleep(0.0002)
        finally:
            self.release(handle)

    @abstractmethod
    def close(self) -> None:
        """Deregister and free the agent."""


@dataclass(frozen=True)
class TransferFaults:
    """Fault drill from `TANDEM_TRANSFER_FAULTS=fail=P,corrupt=P,delay_ms=N`."""

    fail: float = 0.0  # probability a write reports failure (nothing written)
    corrupt: float = 0.0  # probability a write lands, then its pages are overwritten with garbage
    delay_ms: int = 0  # each write lands this much later (on the wire: an abort cannot stop it)

    @classmethod
    def parse(cls, text: str) -> TransferFaults:
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in ("fail", "corrupt", "delay_ms"):
                raise TransferConfigError(
                    f"{FAULTS_ENV}: bad item {item!r}; expected fail=P, corrupt=P or "
                    "delay_ms=N, comma-separated"
                )
            try:
                values[key] = float(raw)
            except ValueError:
                raise TransferConfigError(f"{FAULTS_ENV}: {key} must be a number, got "
                                          f"{raw!r}") from None
        for key in ("fail", "corrupt"):
            if not 0.0 <= values.get(key, 0.0) <= 1.0:
                raise TransferConfigError(f"{FAULTS_ENV}: {key} is a probability in [0, 1], "
                                          f"got {values[key]}")
        if values.get("delay_ms", 0) < 0:
            raise TransferConfigError(f"{FAULTS_ENV}: delay_ms must be >= 0, got "
                                      f"{values['delay_ms']}")
        return cls(values.get("fail", 0.0), values.get("corrupt", 0.0),
                   int(values.get("delay_ms", 0)))

    @classmethod
    def from_env(cls) -> TransferFaults:
        return cls.parse(os.environ.get(FAULTS_ENV, ""))

    @property
    def active(self) -> bool:
        return bool(self.fail or self.corrupt or self.delay_ms)

    def draw(self, rng: random.Random) -> tuple[bool, bool]:
        """(fail this write, corrupt this write)."""
        return rng.random() < self.fail, rng.random() < self.corrupt
