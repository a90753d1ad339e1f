"""Make Mooncake's listeners bind the worker's host (the shim in transfer/bind_host.c).

Mooncake's Transfer Engine binds its handshake daemon and TCP data port to the wildcard
address and has no setting to change it. A worker process that runs Mooncake therefore starts
with `LD_PRELOAD=<the shim>` and `TANDEM_BIND_HOST=<its host>`: `tandem worker` re-executes
itself with that environment (`worker_env`) before anything loads, so every launcher (local,
Slurm, Ray, Kubernetes, by hand) gets it, and the worker's TP ranks inherit it. Mooncake draws
its ports from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT; the shim rewrites wildcard binds only in that
range (TANDEM_BIND_PORTS), so nothing else in the process is touched.

The shim is compiled once per source version with the system C compiler into a cache
directory (TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem). Without a
compiler the worker says so in one line and Mooncake listens on every interface.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

HOST_ENV = "TANDEM_BIND_HOST"
PORTS_ENV = "TANDEM_BIND_PORTS"
SOURCE = Path(__file__).with_name("bind_host.c")
# Mooncake's own default port range, set explicitly so the shim's range and Mooncake's agree.
PORT_RANGE = (15000, 17000)
_WILDCARD = ("", "0.0.0.0", "::")


class ShimUnavailable(RuntimeError):
    """The shim cannot be built here (no C compiler, build error); the message says why."""


def cache_dir(environ: Mapping[str, str]) -> Path:
    if environ.get("TANDEM_CACHE_DIR"):
        return Path(environ["TANDEM_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


def shim_library(environ: Mapping[str, str] | None = None) -> Path:
    """The compiled shim, built on first use (atomically: concurrent workers race harmlessly)."""
    environ = os.environ if environ is None else environ
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:12]
    lib = cache_dir(environ) / f"bind_host-{tag}.so"
    if lib.is_file():
        return lib
    cc = environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ShimUnavailable("no C compiler (cc) to build transfer/bind_host.c; install gcc")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
    out = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = (out.stderr.strip().splitlines() or ["no output"])[0]
        raise ShimUnavailable(f"{cc} could not build transfer/bind_host.c: {first}")
    os.replace(tmp, lib)
    return lib


def bind_address(host: str) -> str:
    """The numeric address the shim binds (it cannot resolve names itself). IPv4 first:
    Mooncake's handshake socket is IPv4, and `localhost` may resolve to ::1 first."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            infos = socket.getaddrinfo(host, None, family=family, type=socket.SOCK_STREAM)
        except OSError:
            continue
        return str(infos[0][4][0])
    return host


def worker_env(
    backend: str, role: str, host: str, environ: Mapping[str, str]
) -> dict[str, str] | None:
    """The environment a worker must re-execute with, or None when it needs no shim (mono,
    not Mooncake, a wildcard host) or already has it. Raises ShimUnavailable."""
    if backend != "mooncake" or role == "both" or host in _WILDCARD:
        return None
    address = bind_address(host)
    if environ.get(HOST_ENV) == address:
        return None  # already re-executed with the shim
    lib = shim_library(environ)
    preload = " ".join(p for p in (str(lib), environ.get("LD_PRELOAD", "")) if p)
    lo, hi = PORT_RANGE
    return {
        **environ,
        "LD_PRELOAD": preload,
        HOST_ENV: address,
        PORTS_ENV: f"{lo}-{hi}",
        "MC_MIN_RPC_PORT": str(lo),
        "MC_MAX_RPC_PORT": str(hi),
    }


def shim_loaded(host: str) -> bool:
    """Whether this process runs with the shim for `host`: the environment names it and the
    library is mapped (a preload that failed only prints a line). Mooncake checks this."""
    if host in _WILDCARD:
        return True
    if os.environ.get(HOST_ENV) != bind_address(host):
        return False
    try:
        return "/bind_host-" in Path("/proc/self/maps").read_text()
    except OSError:  # no procfs: trust the environment
        return True
