"""What the local launcher tells the user when the cluster is up and when it is down.

    ready: http://127.0.0.1:8000 (model tandem-arith; prefill-0 [tp 2, cpu], decode-0 [cpu];
           mooncake tcp; speculative eagle k=3; cluster 3f2a...; logs /path/logs/8000)
    stopped: lb (0), prefill-0 (0), decode-0 (0); logs in /path/logs

Model (its served name), every worker with its ranks and devices, the KV transfer backend
(or "monolithic"), speculative decoding when it is on (method, drafts a step), the URL and
where the logs are: what a user needs to start using it and to find out what went wrong; each
stopped process with its exit status.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import ClusterConfig, dial_address
from orchestrator.rank_map import ProcessRow, plan_processes


def _ranks(rows: list[ProcessRow]) -> str:
    """`tp 2, dp 2, ep 4, cuda:0-3` for one replica's rows (rank 0 first)."""
    r = rows[0]
    parts = [f"{k} {n}" for k, n in (("tp", r.tp_size), ("dp", r.dp_size), ("ep", r.ep_size))
             if n > 1]
    devices = sorted({row.device for row in rows})
    if len(devices) > 1 and all(d.startswith("cuda:") for d in devices):
        first, last = devices[0], max(devices, key=lambda d: int(d[5:]))
        parts.append(f"{first}-{last[5:]}")
    else:
        parts.append(",".join(devices))
    return ", ".join(parts)


def worker_summary(cluster: ClusterConfig) -> str:
    """`prefill-0 [tp 2, cpu], decode-0 [cpu]`: each worker, its ranks and devices."""
    rows = [r for r in plan_processes(cluster) if r.role != "gateway"]
    out = []
    for role, rc in cluster.roles.present():
        for i in range(rc.count):
            mine = [r for r in rows if r.role == role and r.replica == i]
            out.append(f"{role}-{i} [{_ranks(mine)}]")
    return ", ".join(out)


def transfer_summary(cluster: ClusterConfig) -> str:
    if not cluster.roles.is_pd:
        return "monolithic (no KV transfer)"
    t = cluster.transfer
    return f"{t.backend} {t.protocol}" if t.backend == "mooncake" else t.backend


def spec_summary(cluster: ClusterConfig) -> str:
    """`speculative eagle k=3; ` when decode workers draft (k: drafts a step at most), else ''."""
    spec = cluster.speculative
    return f"speculative {spec.method} k={spec.num_speculative_tokens}; " if spec.enabled else ""


def ready_line(cluster: ClusterConfig, log_dir: Path) -> str:
    gw = cluster.gateway
    return (f"ready: http://{dial_address(gw.host, gw.port)} (model {cluster.served_model_name}; "
            f"{worker_summary(cluster)}; {transfer_summary(cluster)}; {spec_summary(cluster)}"
            f"cluster {cluster.launcher.cluster_id}; logs {log_dir.resolve()})")


def stopped_line(names: list[str], log_dir: Path) -> str:
    return (f"stopped: {', '.join(names) or 'nothing was running'}; "
            f"logs in {log_dir.resolve()}")
