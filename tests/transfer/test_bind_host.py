"""The bind-host shim (transfer/bind_host.c): wildcard binds in Mooncake's port range bind the
worker's host, everything else is untouched; and when a worker needs it at all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.bind_host import PORT_RANGE, ShimUnavailable, shim_library, worker_env

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the shim")

PROBE = """
import socket, sys
out = []
for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    for port in (int(sys.argv[1]), int(sys.argv[2])):
        s = socket.socket(family)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack, as asio's
        s.bind((wildcard, port))
        out.append(f"{s.getsockname()[0]}:{s.getsockname()[1]}")
        s.close()
print(" ".join(out))
"""


def free_in(lo: int, hi: int) -> int:
    import socket

    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {lo}..{hi}")


def test_wildcard_binds_in_the_range_bind_the_host_and_the_rest_are_left(tmp_path: Path) -> None:
    env = worker_env("mooncake", "prefill", "127.0.0.1", {"TANDEM_CACHE_DIR": str(tmp_path)})
    assert env is not None and env["TANDEM_BIND_HOST"] == "127.0.0.1"
    assert env["LD_PRELOAD"].startswith(str(tmp_path)) and Path(env["LD_PRELOAD"]).is_file()
    assert (
        env["MC_MIN_RPC_PORT"] == str(PORT_RANGE[0]) and env["TANDEM_BIND_PORTS"] == "15000-17000"
    )
    inside, outside = free_in(*PORT_RANGE), free_in(40000, 41000)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(inside), str(outside)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [
        f"127.0.0.1:{inside}",
        f"0.0.0.0:{outside}",
        f"::ffff:127.0.0.1:{inside}",
        f":::{outside}",
    ]
    # The same probe without the shim: every bind stays on the wildcard (the check can fail).
    plain = subprocess.run(
        [sys.executable, "-c", PROBE, str(inside), str(outside)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert plain[0] == f"0.0.0.0:{inside}"


def test_only_mooncake_pd_workers_on_a_named_host_need_the_shim(tmp_path: Path) -> None:
    base = {"TANDEM_CACHE_DIR": str(tmp_path)}
    assert worker_env("nixl", "decode", "127.0.0.1", base) is None  # UCX_NET_DEVICES instead
    assert worker_env("mooncake", "both", "127.0.0.1", base) is None  # mono: no transfer engine
    assert worker_env("mooncake", "decode", "0.0.0.0", base) is None  # the config says: everywhere
    done = {**base, "TANDEM_BIND_HOST": "127.0.0.1"}
    assert worker_env("mooncake", "decode", "localhost", done) is None  # already re-executed


def test_a_compiler_that_fails_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ShimUnavailable, match="could not build transfer/bind_host.c"):
        shim_library({"TANDEM_CACHE_DIR": str(tmp_path), "CC": "false"})
