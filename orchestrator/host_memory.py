"""Whether a local CPU worker's KV cache can fit this machine, checked before it starts.

A worker allocates its whole KV pool at start (worker/kv_cache.py), so `cache.num_pages` (or
`max_total_tokens`) past the machine's memory is certain to fail, as the allocator's traceback
in the worker's log after the launch. Checked here (serve's preflight, `tandem plan`) it is one
line naming the keys. Only local launches on CPU devices: Slurm and Ray place workers on other
nodes, and a GPU's memory is its own.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orchestrator.config import ClusterConfig, ClusterConfigError
from orchestrator.devices import CudaStatus
from orchestrator.worker_config import device_for

if TYPE_CHECKING:
    from orchestrator.plan import KVBudget  # plan runs this check in its preflight

_GIB = 1 << 30


def memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def check_host_memory(cluster: ClusterConfig, budgets: list[KVBudget], cuda: CudaStatus,
                      total: int | None = None) -> None:
    """ClusterConfigError when one local CPU replica's KV pool (all its ranks) alone exceeds
    the machine's memory (`total`, default: this machine's)."""
    total = memory_bytes() if total is None else total
    if cluster.launcher.kind != "local" or total <= 0:
        return
    for b in budgets:
        if device_for(cluster, b.role, 0, cuda) != "cpu" or b.total_bytes <= total:
            continue
        raise ClusterConfigError(
            f"roles.{b.role}: a {b.role} worker's KV cache needs {b.total_bytes / _GIB:.1f} GiB "
            f"({b.num_pages} pages of {b.page_bytes} bytes) but this machine has "
            f"{total / _GIB:.1f} GiB of memory; lower cache.num_pages (or, when it is 0, "
            "cache.max_total_tokens)")
