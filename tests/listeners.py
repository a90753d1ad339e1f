"""Which TCP ports processes listen on, read from /proc (no `ss`, no psutil).

`listeners(pids)` maps each listening socket of the given processes to (pid, address, port),
with IPv4-mapped IPv6 addresses shown as IPv4 (a dual-stack socket bound to ::ffff:127.0.0.1
listens on 127.0.0.1 only). `descendants(pid)` and `marked(env_marker)` find the processes to
look at: a cluster's whole process tree, or everything a test session started (children that
outlived their parent included, through an environment variable they inherit).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"  # TCP state in /proc/net/tcp*


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # 127.0.0.1, 0.0.0.0, ::, 10.0.0.1 ...
    port: int
    command: str

    def __str__(self) -> str:
        return f"{self.address}:{self.port} (pid {self.pid}: {self.command[:80]})"


def _decode(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:  # one little-endian 32-bit word
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = struct.unpack("<4I", raw)  # four little-endian words
    addr = ipaddress.IPv6Address(struct.pack(">4I", *words))
    return str(addr.ipv4_mapped or addr), int(port, 16)


def _listening_inodes(pid: int) -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                out[int(fields[9])] = _decode(fields[1])
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:  # gone, or not ours to read
        pass
    return inodes


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def listeners(pids: list[int]) -> list[Listener]:
    """Every listening TCP socket held by one of `pids`."""
    out = []
    for pid in pids:
        table = _listening_inodes(pid)
        for inode in _socket_inodes(pid):
            if inode in table:
                address, port = table[inode]
                out.append(Listener(pid, address, port, _command(pid)))
    return out


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    parents = _parents()
    tree, frontier = [root], [root]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def marked(marker: str, value: str) -> list[int]:
    """Processes whose environment holds `marker=value` (inherited from the one that set it)."""
    needle = f"{marker}={value}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            env = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry.name))
    return out
