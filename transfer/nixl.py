"""NIXL backend (UCX): agent metadata travels in the bootstrap registration.

Listen address: UCX opens a TCP listener on every network device it uses (here: one on
loopback and one on eth0). `UCX_NET_DEVICES` limits it to the device that holds the worker's
configured host (plus the RDMA devices of `transfer.ib_device`), so the agent listens only
where the config says; a wildcard host, or a UCX_NET_DEVICES the user set, is left alone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus

log = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_WILDCARD = ("", "0.0.0.0", "::")
# The UCX progress thread's wait between rounds when idle (NIXL's pthrDelay, microseconds).
PROGRESS_DELAY_US = 100


def _ipv4_of(device: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", device.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return ""
    return socket.inet_ntoa(reply[20:24])


def new_agent(label: str, progress_delay_us: int = PROGRESS_DELAY_US) -> Any:
    """A NIXL agent with the UCX backend whose progress thread waits `progress_delay_us` when
    idle.

    nixl's `nixl_agent` sets the agent config's `pthrDelay` to 0 and takes no argument for it;
    with NIXL 1.5 the progress thread then polls with a zero timeout, a core per agent spent
    doing nothing. The config class is swapped, for this one construction, for a subclass
    whose `pthrDelay` keeps our delay; a wrapper without that class gets the default agent and
    a warning.
    """
    import nixl._api as api

    bind: Any = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None:
        log.warning("nixl: no nixlBind.nixlAgentConfig; the progress thread may busy-poll")
        return api.nixl_agent(label, api.nixl_agent_config(backends=["UCX"]))

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

    bind.nixlAgentConfig = _Config
    try:
        return api.nixl_agent(label, api.nixl_agent_config(backends=["UCX"]))
    finally:
        bind.nixlAgentConfig = base


def ucx_net_devices(host: str, ib_devices: str = "") -> str:
    """UCX_NET_DEVICES for an agent that must listen only on `host` ("" = do not restrict).

    RDMA devices (`mlx5_0,mlx5_1`) are kept, on port 1, so the restriction never turns RDMA off.
    """
    if host in _WILDCARD:
        return ""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return ""
    if ipaddress.ip_address(addr).is_loopback:
        device = "lo"
    else:
        device = next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == addr), "")
    if not device:
        log.warning("nixl: no network device holds %s; UCX may listen on every device", host)
        return ""
    rdma = [d if ":" in d else f"{d}:1" for d in ib_devices.split(",") if d]
    return ",".join([device, *rdma])


class NixlBackend(TransferBackend):
    name = "nixl"
    max_range_bytes = 4 << 20

    def __init__(self, agent_label: str, bind_host: str = "", ib_devices: str = "") -> None:
        devices = ucx_net_devices(bind_host, ib_devices)
        if devices and "UCX_NET_DEVICES" not in os.environ:
            # Read by UCX when the agent starts below; set once, before any UCX thread exists.
            os.environ["UCX_NET_DEVICES"] = devices
        self._name = agent_label
        self._agent = new_agent(agent_label)
        self._regs: list[Any] = []
        self._peers: set[str] = set()

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def agent_metadata(self) -> bytes:
        # Refreshed on each call: it must include every region registered so far.
        return bytes(self._agent.get_agent_metadata())

    def register(self, ptr: int, nbytes: int) -> None:
        try:
            self._regs.append(self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM"))
        except Exception as e:  # nixl raises its own binding errors; name the call
            raise BackendError(f"nixl: register_memory(0x{ptr:x}, {nbytes}) failed: {e}") from e

    def connect(self, agent_name: str, metadata: bytes) -> None:
        if agent_name in self._peers:
            return
        if not metadata:
            raise BackendError(
                f"nixl: no agent metadata for peer {agent_name!r}; the registration must carry it"
            )
        added = self._agent.add_remote_agent(metadata)
        name = added.decode() if isinstance(added, bytes) else added
        if name != agent_name:
            raise BackendError(
                f"nixl: metadata names agent {name!r}, registration says {agent_name!r}"
            )
        self._peers.add(agent_name)

    def forget(self, agent_name: str) -> None:
        if agent_name in self._peers:
            self._peers.discard(agent_name)
            self._agent.remove_remote_agent(agent_name)

    def submit(self, peer: str, spans: list[Span]) -> Any:
        local = self._agent.get_xfer_descs([(s, n, 0) for s, _, n in spans], "DRAM")
        remote = self._agent.get_xfer_descs([(d, n, 0) for _, d, n in spans], "DRAM")
        try:
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
        except Exception as e:  # unknown peer / unregistered range
            raise BackendError(f"nixl: initialize_xfer to {peer!r} failed: {e}") from e
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise BackendError(f"nixl: transfer to {peer!r} was refused")
        return handle

    def poll(self, handle: Any) -> WriteStatus:
        state = self._agent.check_xfer_state(handle)
        if state == "DONE":
            return WriteStatus.DONE
        return WriteStatus.FAILED if state == "ERR" else WriteStatus.IN_FLIGHT

    def cancel(self, handle: Any) -> bool:
        try:  # NIXL cancels an active transfer on release, or raises when it cannot yet
            self._agent.release_xfer_handle(handle)
        except Exception:  # nixl's binding errors: still active; poll on, release later
            return False
        return True

    def release(self, handle: Any) -> None:
        self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        for reg in self._regs:
            self._agent.deregister_memory(reg)
        self._regs.clear()
