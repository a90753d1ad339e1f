"""Which backend a transfer config names: the one place that knows every backend module.

Kept apart from transfer/backend.py (the interface) so the interface imports no backend and
each backend imports only the interface.
"""

from __future__ import annotations

import os

from transfer.backend import TransferBackend
from transfer.config import BACKENDS, TransferConfig, TransferConfigError

IB_DEVICE_ENV = "DISAGGREGATION_IB_DEVICE"


def make_backend(config: TransferConfig, host: str, agent_label: str) -> TransferBackend:
    """The backend `config.backend` names (only real ones are selectable)."""
    if config.backend == "mooncake":
        from transfer.mooncake import MooncakeBackend  # each backend loads its library on use

        device = config.ib_device or os.environ.get(IB_DEVICE_ENV, "")
        return MooncakeBackend(host, protocol=config.protocol, ib_device=device)
    if config.backend == "nixl":
        from transfer.nixl import NixlBackend

        return NixlBackend(agent_label)
    if config.backend == "cuda_ipc":
        from transfer.cuda_ipc import CudaIpcBackend

        return CudaIpcBackend(agent_label)
    raise TransferConfigError(
        f"transfer.backend must be one of {' | '.join(BACKENDS)}, got {config.backend!r}")
