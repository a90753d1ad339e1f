"""The ports a local cluster listens on: choose the free ones, check the pinned ones.

Before anything starts, the local launcher
  1. picks free ports for every role whose `base_port` the config leaves unset (0), so a
     second cluster beside a running one needs only its own `--port`;
  2. checks that every port it will listen on (the gateway, every worker replica, a pinned
     `transfer.bootstrap_port` of each prefill rank) is free, and refuses with one line naming
     the port, the process and the config key to change.
Ports the workers draw for themselves (an unpinned bootstrap port, the transfer engines'
ports, torch.distributed's rendezvous) are chosen by the OS or the library at bind time.
"""

from __future__ import annotations

import dataclasses
import errno
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config import ClusterConfig, ClusterConfigError, RoleConfig

# Chosen ports come from below Linux's ephemeral range (32768-60999), where an outgoing
# connection could take one between the check and the worker's bind, and above Mooncake's
# 15000-17000 (transfer/bind_host.py).
CHOSEN_RANGE = (20000, 32000)
_ATTEMPTS = 500


class PortInUseError(ClusterConfigError):
    """A port the cluster must listen on is taken; the message names it and the key."""


@dataclass(frozen=True)
class Listener:
    """One port the cluster will listen on."""

    host: str
    port: int
    who: str  # the process: gateway, prefill-0, prefill-0 bootstrap (rank 1)
    key: str  # the config key that sets it
    host_key: str = ""  # the config key that sets the host


def is_free(host: str, port: int) -> bool:
    """Whether `host:port` can be bound now (SO_REUSEADDR, as the servers bind)."""
    bind_host = "0.0.0.0" if host in ("", "0.0.0.0") else host
    try:
        family = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as exc:  # not a busy port: a host name or address that does not resolve
        raise ClusterConfigError(
            f"host {host!r} does not resolve ({exc.strerror or exc}); "
            "is the host an address of this machine?"
        ) from None
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise ClusterConfigError(
                f"cannot bind {host}:{port} to check it: {exc.strerror}; "
                "is the host an address of this machine?"
            ) from None
    return True


def listeners(cluster: ClusterConfig) -> list[Listener]:
    """Every port the cluster's processes listen on that the config fixes."""
    gw = cluster.gateway
    out = [Listener(gw.host, gw.port, "gateway", "gateway.port (or --port)", "gateway.host")]
    for name, rc in cluster.roles.present():
        for i in range(rc.count):
            out.append(
                Listener(rc.host_of(i), rc.port(i), f"{name}-{i}", f"roles.{name}.base_port",
                         _host_key(name, rc))
            )
    boot = cluster.transfer.bootstrap_port
    if boot and cluster.roles.prefill is not None:
        rc = cluster.roles.prefill
        for i in range(rc.count):
            for r in range(rc.parallel.world_size):
                out.append(
                    Listener(
                        rc.host_of(i),
                        boot + r,
                        f"prefill-{i} bootstrap (rank {r})",
                        "transfer.bootstrap_port",
                        _host_key("prefill", rc),
                    )
                )
    return out


def check_ports(cluster: ClusterConfig, only: Callable[[Listener], bool] | None = None) -> None:
    """PortInUseError for the first port that is taken or claimed twice (of those `only`
    keeps: a Slurm node checks the ones it listens on itself)."""
    seen: dict[tuple[str, int], Listener] = {}
    for ln in filter(only, listeners(cluster)):
        if not ln.port:
            continue
        other = seen.get((ln.host, ln.port))
        if other is not None:
            raise PortInUseError(
                f"port {ln.port}: {ln.who} and {other.who} would both listen "
                f"on {ln.host}:{ln.port}; change {ln.key} (0 = a free port)"
            )
        seen[(ln.host, ln.port)] = ln
        try:
            free = is_free(ln.host, ln.port)
        except ClusterConfigError as exc:
            raise ClusterConfigError(f"{ln.host_key or ln.who}: {exc}") from None
        if not free:
            raise PortInUseError(
                f"port {ln.port} ({ln.who}, {ln.key}) is in use on {ln.host}: "
                f"another cluster? change {ln.key}"
            )


def _choose_base(rc: RoleConfig, taken: set[int], rng: random.Random) -> int:
    lo, hi = CHOSEN_RANGE
    stride = rc.port_stride
    for _ in range(_ATTEMPTS):
        base = rng.randrange(lo, hi - stride * rc.count - 1)
        ports = [base + i * stride for i in range(rc.count)]
        hosts = [rc.host_of(i) for i in range(rc.count)]
        if not taken.intersection(ports) and all(map(is_free, hosts, ports)):
            taken.update(ports)
            return base
    raise PortInUseError(
        f"no free ports for {rc.count} replicas in {lo}..{hi}; pin them with base_port"
    )


def _host_key(name: str, rc: RoleConfig) -> str:
    """The key that sets a role's hosts: `hosts` (one per replica) overrides `host`."""
    return f"roles.{name}.hosts" if rc.hosts else f"roles.{name}.host"


def resolve_ports(cluster: ClusterConfig, rng: random.Random | None = None) -> ClusterConfig:
    """`cluster` with a free base_port for every role that leaves it unset."""
    rng = rng or random.Random()
    taken = {ln.port for ln in listeners(cluster) if ln.port}
    roles = cluster.roles
    for name, rc in roles.present():
        if not rc.base_port:
            try:
                base = _choose_base(rc, taken, rng)
            except PortInUseError:
                raise
            except ClusterConfigError as exc:  # its host does not resolve or is not ours
                raise ClusterConfigError(f"{_host_key(name, rc)}: {exc}") from None
            chosen = dataclasses.replace(rc, base_port=base)
            roles = dataclasses.replace(roles, **{name: chosen})
    return dataclasses.replace(cluster, roles=roles)


def choose_port(host: str, rng: random.Random | None = None) -> int:
    """One free port on `host` from CHOSEN_RANGE (a worker joining a running cluster)."""
    rng = rng or random.Random()
    lo, hi = CHOSEN_RANGE
    for _ in range(_ATTEMPTS):
        port = rng.randrange(lo, hi)
        if is_free(host, port):
            return port
    raise PortInUseError(f"no free port on {host} in {lo}..{hi}; pass --port N")


def require_pinned(cluster: ClusterConfig, launcher: str) -> None:
    """Multi-node launchers dial workers on other nodes: their ports must be in the config.

    Every unset role is named at once, with `--set` lines that pin them: ports from 50051 up,
    above the pinned roles' ranges, each role's replicas `port_stride` apart."""
    present = cluster.roles.present()
    unset = [(name, rc) for name, rc in present if not rc.base_port]
    if not unset:
        return
    span = [rc.base_port + rc.count * max(rc.port_stride, 1) for _, rc in present if rc.base_port]
    port, fixes = max([50051, *span]), []
    for name, rc in unset:
        fixes.append(f"--set roles.{name}.base_port={port}")
        port += rc.count * max(rc.port_stride, 1)
    keys = " and ".join(f"roles.{name}.base_port" for name, _ in unset)
    raise ClusterConfigError(
        f"{keys} {'is' if len(unset) == 1 else 'are'} unset: the {launcher} launcher needs "
        f"explicit worker ports (peers on other nodes dial them); pin them, e.g. "
        f"{' '.join(fixes)}"
    )
