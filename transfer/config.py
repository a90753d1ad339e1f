"""Configuration of the KV transfer layer (one per worker; frozen, composed into WorkerConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Backend = Literal["mooncake", "nixl", "cuda_ipc"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class TransferConfigError(ValueError):
    """A transfer setting is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class TransferConfig:
    backend: Backend = "mooncake"  # cuda_ipc: prefill and decode on one host, KV pools on GPUs
    protocol: str = "tcp"  # mooncake: tcp | rdma
    ib_device: str = ""  # RDMA devices (mooncake rdma); "" = $DISAGGREGATION_IB_DEVICE
    bootstrap_port: int = 0  # prefill's bootstrap service; 0 = any free port (GetInfo reports it)
    advertise_host: str = (
        ""  # host peers use to reach this worker's transfer agent; "" = worker host
    )
    bootstrap_timeout_s: float = (
        10.0  # decode registered, prefill has not started the room (and back)
    )
    waiting_timeout_s: float = 60.0  # room registered, waiting for prefill to compute the prompt
    transfer_timeout_s: float = 10.0  # writes issued, not yet confirmed
    checksum: bool = False  # prefill sends a checksum per page group; decode verifies it
    layerwise_interval: int = (
        0  # 0 = ship after the whole prompt; > 0 = ship every N prefill chunks
    )

    def validate(self, prefix: str = "transfer") -> None:
        if self.backend not in BACKENDS:
            raise TransferConfigError(
                f"{prefix}.backend must be one of {' | '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise TransferConfigError(
                f"{prefix}.protocol must be tcp or rdma, got {self.protocol!r}"
            )
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise TransferConfigError(
                    f"{prefix}.{name} must be > 0 seconds, got {getattr(self, name)}"
                )
        if self.backend == "cuda_ipc" and self.checksum:
            raise TransferConfigError(
                f"{prefix}.checksum reads KV bytes from host memory, and cuda_ipc pools live on "
                f"the GPU; set {prefix}.checksum: false (or use backend mooncake or nixl)"
            )
        if not 0 <= self.bootstrap_port <= 65535:  # gRPC would bind 70000 as 4464
            raise TransferConfigError(f"{prefix}.bootstrap_port must be within 0..65535 "
                                      f"(0 = any free port), got {self.bootstrap_port}")
        if self.layerwise_interval < 0:
            raise TransferConfigError(
                f"{prefix}.layerwise_interval must be >= 0, got {self.layerwise_interval}"
            )
