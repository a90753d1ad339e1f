"""The layout plan: which processes a config starts, where, and how much KV each one holds.

`plan_processes` is the single source of the process list: `tandem plan` prints it and the
launchers start exactly these processes. `kv_budget` reads the checkpoint's config.json
directly (no torch import: planning must work on a machine without the engine) and checks
the TP divisibility rules before anything starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import ClusterConfig, ClusterConfigError, device_for, worker_config

# Bytes per element of the dtypes a checkpoint's config.json may name.
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ProcessRow:
    """One process of the cluster (a worker replica's TP rank, or the gateway)."""

    name: str  # log / process name: prefill-0, decode-1, both-0, lb
    role: str  # prefill | decode | both | gateway
    replica: int  # -1 for the gateway
    host: str
    port: int  # 0 for a TP rank > 0 (it listens on no public port)
    device: str
    tp_rank: int
    tp_size: int


@dataclass(frozen=True)
class KVBudget:
    """KV capacity of one role's workers (per replica, all TP ranks together)."""

    role: str
    page_size: int
    num_pages: int
    page_bytes: int  # one page, all layers, K and V, summed over the replica's TP ranks
    dtype: str

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def plan_processes(cluster: ClusterConfig) -> list[ProcessRow]:
    """Every process in launch order: workers (each replica's TP ranks), then the gateway."""
    rows: list[ProcessRow] = []
    for role, rc in cluster.roles.present():
        for i in range(rc.count):
            dev0 = device_for(cluster, role, i)
            for rank in range(rc.parallel.tp_size):
                # A TP group takes consecutive GPUs from its rank 0's.
                dev = f"cuda:{int(dev0[5:]) + rank}" if dev0.startswith("cuda:") else dev0
                rows.append(ProcessRow(
                    name=f"{role}-{i}" if rank == 0 else f"{role}-{i}.tp{rank}",
                    role=role, replica=i, host=rc.host, port=rc.port(i) if rank == 0 else 0,
                    device=dev, tp_rank=rank, tp_size=rc.parallel.tp_size,
                ))
    gw = cluster.gateway
    rows.append(ProcessRow("lb", "gateway", -1, gw.host, gw.port, "cpu", 0, 1))
    return rows


def read_model_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; ClusterConfigError naming the path if absent."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ClusterConfigError(f"model.path: {path} not found; point model.path (or --model) at an HF-format directory")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _kv_dtype(cluster: ClusterConfig, hf: dict[str, Any]) -> str:
    if cluster.model.dtype != "auto":
        return cluster.model.dtype
    name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    # worker/config.py: auto on CPU runs a float16 checkpoint in float32 (fp16 matmuls are slow there).
    return "float32" if name in ("float16", "half") else name


def kv_budget(cluster: ClusterConfig, hf: dict[str, Any]) -> list[KVBudget]:
    """Pages and bytes per page for each role, from the HF config.json `hf`."""
    layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    dtype = _kv_dtype(cluster, hf)
    if dtype not in _DTYPE_BYTES:
        raise ClusterConfigError(f"model.dtype: cannot size a KV cache of dtype {dtype!r}; set model.dtype to float32 or bfloat16")
    out: list[KVBudget] = []
    for role, rc in cluster.roles.present():
        tp = rc.parallel.tp_size
        if heads % tp:
            raise ClusterConfigError(f"roles.{role}.parallel.tp_size={tp} must divide num_attention_heads={heads}")
        if kv_heads % tp and tp % kv_heads:
            raise ClusterConfigError(
                f"roles.{role}.parallel.tp_size={tp} must divide num_key_value_heads={kv_heads} "
                "or be a multiple of it (KV heads are then replicated)"
            )
        kv_per_rank = max(1, kv_heads // tp)
        cache = worker_config(cluster, role, 0).cache
        page_bytes = layers * 2 * kv_per_rank * cache.page_size * head_dim * _DTYPE_BYTES[dtype] * tp
        out.append(KVBudget(role, cache.page_size, cache.total_pages, page_bytes, dtype))
    return out


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def format_plan(cluster: ClusterConfig) -> str:
    """The text `tandem plan` prints: the process table, then the KV budget per role."""
    rows = plan_processes(cluster)
    table = _table(
        ["process", "role", "replica", "host", "port", "device", "tp"],
        [[r.name, r.role, str(r.replica) if r.replica >= 0 else "-", r.host, str(r.port) if r.port else "-",
          r.device, f"{r.tp_rank}/{r.tp_size}"] for r in rows],
    )
    mode = "disaggregated (prefill/decode)" if cluster.roles.is_pd else "monolithic (both)"
    parts = [f"model: {cluster.model.path} (served as {cluster.served_model_name}); {mode}; "
             f"launcher: {cluster.launcher.kind}", "", table, ""]
    try:
        budgets = kv_budget(cluster, read_model_config(cluster.model.path))
    except ClusterConfigError as exc:
        if "not found" not in str(exc):
            raise
        parts.append(f"KV budget: unknown ({exc})")
        return "\n".join(parts)
    parts.append(_table(
        ["role", "pages/worker", "page_size", "bytes/page", "KV/worker", "dtype"],
        [[b.role, str(b.num_pages), str(b.page_size), str(b.page_bytes), _human(b.total_bytes), b.dtype] for b in budgets],
    ))
    return "\n".join(parts)
