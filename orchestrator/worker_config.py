"""What each worker process is started with, derived from the cluster config.

`worker_config` gives the WorkerConfig of one replica of a role (its rank 0: a TP worker spawns
the others); `device_for` places replicas on GPUs per host in launch order; `dist_init_addr` is
a multi-node replica's torch.distributed rendezvous.
"""

from __future__ import annotations

import dataclasses

from orchestrator.config import ClusterConfig, RoleConfig, dial_address
from orchestrator.config_checks import ClusterConfigError, same_host
from orchestrator.devices import CudaStatus, cuda_status, resolve_device
from worker.config import ParallelConfig, WorkerConfig


def device_for(cluster: ClusterConfig, role: str, replica: int,
               cuda: CudaStatus | None = None) -> str:
    """The device of a replica's rank 0: `cuda` hands out GPUs per host in launch order;
    `auto` is `cuda` where `cuda` (default: this machine's status) says CUDA is usable."""
    cuda = cuda or cuda_status()
    rc = cluster.role(role)
    if resolve_device(rc.parallel.device, cuda) != "cuda":
        return resolve_device(rc.parallel.device, cuda)
    nxt = 0
    for name, other in cluster.roles.present():
        if resolve_device(other.parallel.device, cuda) != "cuda":
            continue
        for i in range(other.count):
            if not same_host(other.host_of(i), rc.host_of(replica)):
                continue
            if name == role and i == replica:
                return f"cuda:{nxt}"
            nxt += other.parallel.world_size // other.parallel.nnodes
    raise ClusterConfigError(f"roles.{role}: replica {replica} is out of range (count {rc.count})")


def worker_config(cluster: ClusterConfig, role: str, replica: int = 0) -> WorkerConfig:
    """The WorkerConfig of one replica of `role` (its rank 0; a TP worker spawns the others)."""
    rc = cluster.role(role)
    if not 0 <= replica < rc.count:
        raise ClusterConfigError(
            f"--replica {replica} is out of range: roles.{role}.count is {rc.count} "
            f"(0..{rc.count - 1})"
        )
    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        host=rc.host_of(replica),
        port=rc.port(replica),
        model=dataclasses.replace(cluster.model, served_model_name=cluster.served_model_name),
        cache=rc.cache or cluster.cache,
        scheduler=rc.scheduler or cluster.scheduler,
        parallel=_worker_parallel(rc, replica, device_for(cluster, role, replica)),
        transfer=cluster.transfer,
        num_threads=rc.num_threads,
        tls=cluster.tls,
        speculative=cluster.speculative,
        cluster_id=cluster.launcher.cluster_id,
        replica=replica,
        drain_timeout_s=rc.drain_timeout_s,
    )


def dist_init_addr(rc: RoleConfig, replica: int) -> str:
    """The replica's torch.distributed rendezvous: given, or its node-0 host at port + 1."""
    if rc.parallel.dist_init_addr:
        return rc.parallel.dist_init_addr
    if rc.parallel.nnodes == 1:
        return ""  # the worker picks a free local port itself
    return (
        f"tcp://{dial_address(rc.host_of(replica), rc.port(replica) + 1).split(':')[0]}"
        f":{rc.port(replica) + 1}"
    )


def _worker_parallel(rc: RoleConfig, replica: int, device: str) -> ParallelConfig:
    p = rc.parallel
    return ParallelConfig(
        tp_size=p.tp_size, tp_rank=0, device=device, dp_size=p.dp_size, ep_size=p.ep_size,
        all2all_backend=p.all2all_backend, nnodes=p.nnodes, node_rank=0,
        dist_init_addr=dist_init_addr(rc, replica),
    )
