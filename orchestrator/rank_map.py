"""The rank map of a config: every rank process, where it runs and which ranks it holds.

`plan_processes` is the single source of the process list: `tandem plan` prints it
(orchestrator/plan.py) and the launchers start exactly these processes (one per node of each
replica: its local rank 0 spawns the node's other ranks).

Node placement: the local launcher puts everything on this machine (node 0). Slurm and Ray
give each replica `parallel.nnodes` nodes of its own, in launch order (prefill replicas, then
decode, then both); the gateway runs on node 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import ClusterConfig, RoleConfig
from orchestrator.devices import CudaStatus, cuda_status, resolve_device
from orchestrator.worker_config import device_for


@dataclass(frozen=True)
class ProcessRow:
    """One rank process of the cluster (or the gateway): where it runs and which ranks it holds."""

    name: str  # log / process name: prefill-0, decode-1.r3 (rank 3), both-0, lb
    role: str  # prefill | decode | both | gateway
    replica: int  # -1 for the gateway
    host: str
    port: int  # 0 for a rank > 0 (it listens on no public port)
    device: str  # cpu | cuda:N (N = the GPU index on its node)
    tp_rank: int  # attention TP rank within its DP group
    tp_size: int
    node: int = 0  # cluster node index (0 = the gateway's node)
    node_rank: int = 0  # which of the replica's nnodes this is
    rank: int = 0  # global rank within the replica's world (tp_size * dp_size)
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = -1  # -1 when the role has no expert parallelism
    ep_size: int = 1
    nnodes: int = 1  # nodes the replica spans

    @property
    def starts_node(self) -> bool:
        """The process a launcher starts on its node (local rank 0; it spawns the others)."""
        return self.role == "gateway" or self.rank % max(1, self.world_size // self.nnodes) == 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


def procs_per_node(rc: RoleConfig) -> int:
    """Rank processes of one replica on each of its nodes."""
    p = rc.parallel
    return p.procs_per_node or max(1, p.world_size // p.nnodes)


def spreads_over_nodes(cluster: ClusterConfig) -> bool:
    """True when each replica gets nodes of its own (Slurm, Ray); False: all on this machine."""
    return cluster.launcher.kind != "local"


def replica_nodes(cluster: ClusterConfig) -> dict[tuple[str, int], int]:
    """(role, replica) -> index of the replica's first node, in launch order."""
    out: dict[tuple[str, int], int] = {}
    nxt = 0
    for role, rc in cluster.roles.present():
        for i in range(rc.count):
            out[(role, i)] = nxt if spreads_over_nodes(cluster) else 0
            nxt += rc.parallel.nnodes
    return out


def num_nodes(cluster: ClusterConfig) -> int:
    """Nodes the cluster needs (the Slurm allocation's size)."""
    if not spreads_over_nodes(cluster):
        return 1
    return sum(rc.count * rc.parallel.nnodes for _, rc in cluster.roles.present())


def plan_processes(cluster: ClusterConfig, cuda: CudaStatus | None = None) -> list[ProcessRow]:
    """Every rank process in launch order: workers (each replica's ranks), then the gateway.
    `cuda`: the machine's CUDA status (default: probed here), which `device: auto` follows."""
    cuda = cuda or cuda_status()
    rows: list[ProcessRow] = []
    first_node = replica_nodes(cluster)
    for role, rc in cluster.roles.present():
        p = rc.parallel
        per_node = procs_per_node(rc)
        for i in range(rc.count):
            # Nodes of their own start at GPU 0; on one machine GPUs are handed out in order.
            spread = spreads_over_nodes(cluster) and resolve_device(p.device, cuda) == "cuda"
            dev0 = "cuda:0" if spread else device_for(cluster, role, i, cuda)
            for g in range(p.world_size):
                local = g % per_node
                # A node's ranks take consecutive GPUs from its local rank 0's.
                dev = f"cuda:{int(dev0[5:]) + local}" if dev0.startswith("cuda:") else dev0
                node = first_node[(role, i)] + g // per_node
                # Before a multi-node launcher resolves them, hosts are named by node index.
                host = (
                    f"node{node}" if spreads_over_nodes(cluster) and not rc.hosts else rc.host_of(i)
                )
                rows.append(ProcessRow(
                    name=f"{role}-{i}" if g == 0 else f"{role}-{i}.r{g}",
                    role=role, replica=i, host=host, port=rc.port(i) if g == 0 else 0,
                    device=dev, tp_rank=g % p.tp_size, tp_size=p.tp_size,
                    node=node, node_rank=g // per_node, rank=g,
                    dp_rank=g // p.tp_size, dp_size=p.dp_size,
                    ep_rank=g if p.ep_size > 1 else -1, ep_size=p.ep_size, nnodes=p.nnodes,
                ))
    gw = cluster.gateway
    rows.append(ProcessRow("lb", "gateway", -1, gw.host, gw.port, "cpu", 0, 1))
    return rows
