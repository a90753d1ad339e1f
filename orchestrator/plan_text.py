"""`tandem plan`'s text: the rank map, the KV budget and the cache groups of a config, as
tables. The rules and the budget themselves are orchestrator/plan.py's.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoint import CheckpointError, check_drafter, check_for_plan, model_dir
from orchestrator.config import ClusterConfig, ClusterConfigError
from orchestrator.devices import CudaStatus, cuda_status, resolve_device
from orchestrator.host_memory import check_host_memory
from orchestrator.hub import looks_like_repo_id
from orchestrator.kv_groups import RECURRENT, WINDOW, KVGroup
from orchestrator.launch.describe import spec_summary
from orchestrator.plan import LayoutError, check_layout, kv_budget, read_model_config
from orchestrator.rank_map import ProcessRow, num_nodes, plan_processes
from orchestrator.weights import WeightBytes


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
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


def format_rank_map(rows: list[ProcessRow]) -> str:
    """The rank map as a table: one line per rank process, then the gateway."""
    return _table(
        ["process", "role", "replica", "host", "port", "device", "node", "tp", "dp", "ep", "rank"],
        [
            [
                r.name,
                r.role,
                str(r.replica) if r.replica >= 0 else "-",
                r.host,
                str(r.port) if r.port else "-",
                r.device,
                str(r.node),
                f"{r.tp_rank}/{r.tp_size}",
                f"{r.dp_rank}/{r.dp_size}",
                f"{r.ep_rank}/{r.ep_size}" if r.ep_rank >= 0 else "-",
                f"{r.rank}/{r.world_size}",
            ]
            for r in rows
        ],
    )


def format_plan(cluster: ClusterConfig, cuda: CudaStatus | None = None) -> str:
    """The text `tandem plan` prints: the rank map, then the KV budget per role.

    Raises LayoutError for a broken rule (the shape rules only when config.json is there).
    """
    cuda = cuda or cuda_status()
    check_layout(cluster, None, cuda)
    rows = plan_processes(cluster, cuda)
    mode = "disaggregated (prefill/decode)" if cluster.roles.is_pd else "monolithic (both)"
    parts = [
        f"model: {cluster.model.path} (served as {cluster.served_model_name}); {mode}; "
        f"{spec_summary(cluster)}launcher: {cluster.launcher.kind}; nodes: {num_nodes(cluster)}",
        "",
        format_rank_map(rows),
        "",
    ]
    if any(rc.parallel.device == "auto" for _, rc in cluster.roles.present()):
        why = f"{cuda.gpus} GPUs" if cuda.available else cuda.why_not()
        parts[1:1] = [f"device auto: {resolve_device('auto', cuda)} ({why})"]
    try:
        hf = read_model_config(cluster.model.path)
        # What serve's preflight checks (architecture, family fields, weights, tokenizer):
        # the same one line here, not a plan that the launch then refuses.
        path = Path(cluster.model.path)  # serve's checks, in the same one line
        arch = check_for_plan(path, hf, cluster.model.load_format)
        if arch is not None:
            check_drafter(cluster, path, arch)
        budgets = kv_budget(cluster, hf, cuda)
        check_host_memory(cluster, budgets, cuda)
    except LayoutError:
        raise
    except ClusterConfigError as exc:
        if "not found" not in str(exc):
            raise
        parts.append(f"KV budget: unknown ({_model_not_here(cluster.model.path, exc)})")
        return "\n".join(parts)
    parts.append(_table(
        ["role", "pages/worker", "page_size", "KV bytes/page", "KV/worker", "KV dtype",
         "weights/worker", "weights dtype"],
        [[b.role, str(b.num_pages), str(b.page_size), str(b.page_bytes), _human(b.total_bytes),
          b.dtype, _weights_cell(b.weights), b.weights.dtype if b.weights else "-"]
         for b in budgets],
    ))
    group_rows = [[b.role, g.kind, _layers_cell(g, b.speculative),
                   _human(g.bytes_per_token) if g.bytes_per_token else "-",
                   _human(g.bytes_per_token // b.tp_size) if g.bytes_per_token else "-",
                   _human(g.bytes_per_request) if g.bytes_per_request else "-",
                   _kept(g, b.page_size)] for b in budgets for g in b.groups]
    parts += ["", "KV cache groups (bytes/token: all TP ranks of a replica; an MLA latent is whole "
              "on every rank):",
              _table(["role", "group", "layers", "bytes/token", "per rank", "bytes/request",
                      "kept per request"], group_rows)]
    return "\n".join(parts)


def _model_not_here(model_path: str, exc: ClusterConfigError) -> str:
    """Why the KV budget is unknown: a Hugging Face name says where it looked in the local
    cache and how to fetch it (as `tandem serve` does), not `ORG/NAME/config.json not found`."""
    if not Path(model_path).expanduser().is_dir() and looks_like_repo_id(model_path):
        try:
            model_dir(model_path)
        except CheckpointError as hub:
            return str(hub)
    return str(exc)


def _layers_cell(group: KVGroup, method: str) -> str:
    if not group.draft_layers:
        return str(len(group.layers))
    return f"{len(group.layers) - group.draft_layers} + {group.draft_layers} {method}"


def _kept(group: KVGroup, page_size: int) -> str:
    if group.kind == WINDOW:
        return f"last {group.window} tokens (ring of {group.ring_pages(page_size)} pages)"
    if group.kind == RECURRENT:
        return "one state slot"
    return "every token"


def _weights_cell(w: WeightBytes | None) -> str:
    if w is None:
        return "-"
    return _human(w.total) + ("" if w.exact else " (est.)")
