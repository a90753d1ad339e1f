"""Which backend a transfer config names: the one place that knows every backend module.

Kept apart from transfer/backend.py (the interface) so the interface imports no backend and
each backend imports only the interface.
"""

from __future__ import annotations

import os

from transfer.backend import TransferBackend
from transfer.config import BACKENDS, TransferConfig, TransferConfigError

IB_DEVICE_ENV = "DISAGGREGATION_IB_DEVICE"


def make_backend(config: TransferConfig, host: str, agent_label: str,
                 bind_host: str = "") -> TransferBackend:
    """The backend `config.backend` names (only real ones are selectable).

    `host` is how peers reach this agent; `bind_host` where its listeners bind ("" = host).
    """
    device = config.ib_device or os.environ.get(IB_DEVICE_ENV, "")
    if config.backend == "mooncake":
        from transfer.mooncake import MooncakeBackend  # each backend loads its library on use

        return MooncakeBackend(host, protocol=config.protocol, ib_device=device,
                               bind_host=bind_host or host)
    if config.backend == "nixl":
        from transfer.nixl import NixlBackend

        return NixlBackend(agent_label, bind_host=bind_host or host, ib_devices=device)
    if config.backend == "cuda_ipc":
        from transfer.cuda_ipc import CudaIpcBackend

        return CudaIpcBackend(agent_label)
    raise TransferConfigError(
        f"transfer.backend must be one of {' | '.join(BACKENDS)}, got {config.backend!r}")
