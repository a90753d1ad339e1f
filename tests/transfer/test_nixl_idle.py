"""An idle NIXL agent sleeps: its UCX progress thread waits for events instead of spinning.

nixl's Python wrapper hard-codes the progress thread's delay to 0, and NIXL 1.5's UCX progress
loop then polls with a zero timeout: every NIXL worker burned 30-100 % of a core doing nothing
(four workers of configs/tiny-2p2d.yaml took both cores of the box, and the cluster served
~8x slower than with Mooncake). The backend creates its agent with a nonzero delay.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("nixl._api")

PROBE = """
import ctypes, resource, time
from transfer.nixl import NixlBackend
b = NixlBackend("idle-probe", "127.0.0.1")
buf = ctypes.create_string_buffer(1 << 20)  # a registered pool, as a worker has
b.register(ctypes.addressof(buf), len(buf))
time.sleep(0.5)
r0 = resource.getrusage(resource.RUSAGE_SELF)
time.sleep(3.0)
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 3))
b.close()
"""


def test_idle_agent_uses_almost_no_cpu() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True)
    cpu_s = float(out.stdout.strip().splitlines()[-1])
    # 3 s idle: a sleeping agent takes ~0.05 s; a spinning one its whole share of a core.
    assert cpu_s < 0.3, f"an idle NIXL agent used {cpu_s} s of CPU in 3 s (a busy poll)"
