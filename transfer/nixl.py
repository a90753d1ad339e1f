"""NIXL backend (UCX): agent metadata travels in the bootstrap registration."""

from __future__ import annotations

from typing import Any

from transfer.backend import BackendError, Span, TransferBackend, WriteStatus


class NixlBackend(TransferBackend):
    name = "nixl"
    max_range_bytes = 4 << 20

    def __init__(self, agent_label: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self._name = agent_label
        self._agent = nixl_agent(agent_label, nixl_agent_config(backends=["UCX"]))
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
            raise BackendError(f"nixl: no agent metadata for peer {agent_name!r}; the registration must carry it")
        added = self._agent.add_remote_agent(metadata)
        name = added.decode() if isinstance(added, bytes) else added
        if name != agent_name:
            raise BackendError(f"nixl: metadata names agent {name!r}, registration says {agent_name!r}")
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
