"""A prefill's bootstrap service owns its port: a second process asking for it is refused.

gRPC servers set SO_REUSEPORT unless told otherwise, so a second prefill started with the
same pinned `transfer.bootstrap_port` (a `tandem worker --join` with the run's cluster.yaml)
bound it too and came up SERVING: the kernel then split decode's registrations between the
two processes, and a room registered at the process that does not hold it never lands.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.transfer.helpers import layout
from transfer.config import TransferConfig, TransferConfigError
from transfer.manager import KVTransferManager

# The other process: a real prefill manager serving its bootstrap on the port in argv[1].
_OTHER = """
import sys, torch
from transfer.config import TransferConfig
from transfer.manager import KVTransferManager
from tests.transfer.helpers import layout
lay = layout()
pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8)
mgr = KVTransferManager(TransferConfig(backend="mooncake"), lay, role="prefill",
                        kv_ptr=pool.data_ptr(), kv_nbytes=pool.numel(), host="127.0.0.1",
                        model_fingerprint="fp", model_name="tiny")
server, port = mgr.serve_bootstrap("127.0.0.1", int(sys.argv[1]))
print(port, flush=True)
sys.stdin.read()  # serve until the test closes our stdin
"""


def _manager() -> tuple[KVTransferManager, object]:
    import torch

    lay = layout()
    pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8)
    mgr = KVTransferManager(TransferConfig(backend="mooncake"), lay, role="prefill",
                            kv_ptr=pool.data_ptr(), kv_nbytes=pool.numel(), host="127.0.0.1",
                            model_fingerprint="fp", model_name="tiny")
    return mgr, pool


def test_a_bootstrap_port_another_process_serves_is_refused() -> None:
    other = subprocess.Popen([sys.executable, "-c", _OTHER, "0"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None
        port = int(other.stdout.readline())
        mgr, _pool = _manager()
        try:
            with pytest.raises(TransferConfigError, match=f"127.0.0.1:{port}"):
                server, _ = mgr.serve_bootstrap("127.0.0.1", port)
                server.stop(grace=None)
        finally:
            mgr.close()
    finally:
        assert other.stdin is not None
        other.stdin.close()
        other.wait(timeout=30)
