"""The layout plan: every layout rule of a config, and the KV budget.

The rank map itself (`plan_processes`, the single source of the process list) is
orchestrator/rank_map.py; `tandem plan`'s text is orchestrator/plan_text.py. `check_layout`
applies every rule that can be checked before a GPU is touched; `kv_budget` reads the
checkpoint's config.json directly (no torch import: planning must work on a machine without
the engine). `preflight` is what the local launcher runs before it starts a process: the
checkpoint's checks (orchestrator/checkpoint.py), then every layout rule against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfigError
from gateway.sampling_defaults import describe, load_sampling_defaults
from orchestrator.checkpoint import (
    OPTIONAL_FIELDS,
    REQUIRED_FIELDS,
    check_checkpoint,
    check_drafter,
    read_config_json,
)
from orchestrator.config import ClusterConfig, ClusterConfigError, RoleConfig
from orchestrator.devices import CudaStatus, cuda_status, resolve_device
from orchestrator.host_memory import check_host_memory
from orchestrator.kv_groups import FULL, MLA, RECURRENT, WINDOW, KVGroup, kv_groups, mla_latent_dim
from orchestrator.rank_map import (
    plan_processes,
    procs_per_node,
    spreads_over_nodes,
)
from orchestrator.weights import WeightBytes, weight_bytes
from orchestrator.worker_config import device_for, dist_init_addr, worker_config
from worker.arch.hf_config import context_limit
from worker.arch.load import config_dtype
from worker.config import ConfigError, SpeculativeConfig, WorkerConfig

# Bytes per element of the dtypes a checkpoint's config.json may name.
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# cache.kv_cache_dtype → the pages' dtype and bytes per element ("auto": the model dtype's).
_KV_CACHE_DTYPES = {"fp8_e4m3": ("float8_e4m3fn", 1)}
_WINDOW_RINGS_PER_SEQ = 2  # worker/cache_layout.py: decode holds rings of rooms in flight too
_STATE_SLOTS_PER_SEQ = 3  # worker/cache_layout.py: 2 per seat (rooms in flight) + 1 snapshot
# Keys of config.json that name the routed-expert count (Qwen-MoE, Mixtral, DeepSeek).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class LayoutError(ClusterConfigError):
    """A parallel layout rule is broken; the message names the field, the numbers and the fix."""


@dataclass(frozen=True)
class KVBudget:
    """KV capacity of one role's workers (per replica, all TP ranks together)."""

    role: str
    page_size: int
    num_pages: int
    # One page: its group's layers (all but ring-kept window layers), K and V, all TP ranks.
    page_bytes: int
    dtype: str  # of the KV pages (cache.kv_cache_dtype)
    groups: tuple[KVGroup, ...] = ()  # the cache groups (orchestrator/kv_groups.py)
    window_bytes: int = 0  # the window-ring region (models whose window layers keep rings)
    state_bytes: int = 0  # the recurrent-state region: request and snapshot slots
    tp_size: int = 1  # ranks of one replica (the groups' bytes/token count all of them)
    weights: WeightBytes | None = None  # the replica's weights in the dtype it holds them in
    speculative: str = "none"  # speculative.method (a model drafter's layers are in groups)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.window_bytes + self.state_bytes


# Plan requires only the config.json fields its page sizes need (a shape-only config.json
# plans); checkpoint.py's other integer fields, when present, must be integers too.
_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers")
_OPTIONAL_FIELDS = tuple(f for f in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS)
                         if f not in _REQUIRED_FIELDS)


def read_model_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; ClusterConfigError naming the path if absent."""
    return read_config_json(Path(model_path) / "config.json", _REQUIRED_FIELDS)


def drafter_kv_layers(speculative: SpeculativeConfig, model_path: str) -> int:
    """The KV layers a model drafter adds to the paged group (worker/spec/load.py): one for
    eagle and mtp (an MTP layer of the checkpoint or a module beside it), the draft model's
    `num_hidden_layers` for draft, none for ngram."""
    if speculative.method != "draft":
        return 1 if speculative.method in ("eagle", "mtp") else 0
    path = Path(speculative.drafter_path(model_path)) / "config.json"
    if not path.is_file():
        raise ClusterConfigError(f"speculative.model: {path} not found; point speculative.model "
                                 "at the draft model's directory")
    return int(json.loads(path.read_text())["num_hidden_layers"])


def _kv_dtype(cluster: ClusterConfig, hf: dict[str, Any]) -> str:
    if cluster.model.dtype != "auto":
        return cluster.model.dtype
    name = (config_dtype(hf, Path(cluster.model.path)) or "float32").replace("torch.", "")
    # worker/config.py: auto on CPU runs a float16 checkpoint in float32
    # (fp16 matmuls are slow there).
    return "float32" if name in ("float16", "half") else name


def check_layout(cluster: ClusterConfig, hf: dict[str, Any] | None = None,
                 cuda: CudaStatus | None = None) -> None:
    """Every layout rule; LayoutError names the first one broken. `hf`: the checkpoint's
    config.json (None = skip the rules that need the model's shapes); `cuda`: the machine's
    CUDA status (default: probed here)."""
    cuda = cuda or cuda_status()
    check_devices(cluster, cuda)
    for role, rc in cluster.roles.present():
        _check_world(cluster, role, rc, cuda)
        _check_moe(cluster, role, rc, hf)
        if hf is not None:
            _check_shapes(role, rc, hf)
            _check_multi_rank_groups(cluster, role, rc, hf)
            _check_step_budget(cluster, role, hf)
        for i in range(rc.count):
            _check_dist_init(role, rc, i)
    _check_gpu_count(cluster, cuda)


def check_devices(cluster: ClusterConfig, cuda: CudaStatus) -> None:
    """A local cluster's cuda roles need CUDA here, and GPUs enough, and cuda_ipc needs both PD
    roles on cuda (Slurm / Ray nodes are not this machine: their devices are checked where they
    run)."""
    if spreads_over_nodes(cluster):
        return
    fix = "set device: auto or cpu, or plan for a GPU machine with `tandem plan --gpus N`"
    for role, rc in cluster.roles.present():
        dev = rc.parallel.device
        if dev.startswith("cuda") and not cuda.available:
            raise LayoutError(f"roles.{role}.parallel.device={dev}: CUDA is not usable here "
                              f"({cuda.why_not()}); {fix}")
    if cluster.transfer.backend == "cuda_ipc" and cluster.roles.both is None:
        for role, rc in cluster.roles.present():  # cuda_ipc maps the decode GPU's KV pool
            dev = resolve_device(rc.parallel.device, cuda)
            if not dev.startswith("cuda"):
                raise LayoutError(
                    f"transfer.backend=cuda_ipc: roles.{role} runs on {dev} (parallel.device="
                    f"{rc.parallel.device}), and CUDA IPC copies KV between GPUs of one host; "
                    "use transfer.backend mooncake or nixl, or put both roles on cuda")


def _check_gpu_count(cluster: ClusterConfig, cuda: CudaStatus) -> None:
    if spreads_over_nodes(cluster):
        return
    rows = [r for r in plan_processes(cluster, cuda) if r.device.startswith("cuda:")]
    top = max((int(r.device[5:]) for r in rows), default=-1)
    if top >= cuda.gpus > 0:
        raise LayoutError(f"roles: the cuda roles use GPUs cuda:0..cuda:{top} ({len(rows)} "
                          f"rank processes) but this machine has {cuda.gpus}; lower counts or "
                          "tp_size, or use a multi-node launcher")


def _check_world(cluster: ClusterConfig, role: str, rc: RoleConfig, cuda: CudaStatus) -> None:
    p, where = rc.parallel, f"roles.{role}.parallel"
    on_cuda = resolve_device(p.device, cuda).startswith("cuda")
    world = p.world_size
    if p.procs_per_node and p.nnodes * p.procs_per_node != world:
        raise LayoutError(
            f"{where}: world size nnodes*procs_per_node = {p.nnodes}*{p.procs_per_node} = "
            f"{p.nnodes * p.procs_per_node} but attention tp_size*dp_size = "
            f"{p.tp_size}*{p.dp_size} = {world}; they must be equal (change tp_size, dp_size, "
            "nnodes or procs_per_node)"
        )
    if world % p.nnodes:
        raise LayoutError(
            f"{where}: tp_size*dp_size = {world} ranks do not split evenly over nnodes={p.nnodes}; "
            "make the world a multiple of nnodes"
        )
    kind = cluster.launcher.kind
    if p.nnodes > 1 and kind != "slurm":
        raise LayoutError(
            f"{where}.nnodes={p.nnodes}: launcher.kind={kind} runs each worker on one node; "
            "use launcher.kind=slurm for multi-node workers or set nnodes=1"
        )
    gpus = cluster.launcher.gpus_per_node
    if gpus and on_cuda and procs_per_node(rc) > gpus:
        raise LayoutError(
            f"{where}: {procs_per_node(rc)} ranks per node but launcher.gpus_per_node={gpus}; "
            f"raise nnodes to {-(-world // gpus)} or lower tp_size/dp_size"
        )
    if gpus and on_cuda and not spreads_over_nodes(cluster):
        used = sum(o.count * procs_per_node(o) for _, o in cluster.roles.present()
                   if resolve_device(o.parallel.device, cuda) == "cuda")
        if used > gpus:
            raise LayoutError(
                f"roles: the cuda roles need {used} GPUs on this machine but "
                f"launcher.gpus_per_node={gpus}; "
                "lower counts or tp_size, or use a multi-node launcher"
            )


def _check_moe(
    cluster: ClusterConfig, role: str, rc: RoleConfig, hf: dict[str, Any] | None
) -> None:
    p, where = rc.parallel, f"roles.{role}.parallel"
    world = p.world_size
    if p.ep_size > world:
        raise LayoutError(f"{where}.ep_size={p.ep_size} exceeds the world tp_size*dp_size={world}: "
                          "EP must be <= world (each rank holds at least one expert group)")
    if p.ep_size not in (1, world):
        raise LayoutError(
            f"{where}.ep_size={p.ep_size}: the engine runs MoE with ep_size 1 (TP-sharded experts) "
            f"or ep_size = world = {world}; set one of those"
        )
    if p.all2all_backend == "deepep" and p.ep_size == 1:
        raise LayoutError(f"{where}.all2all_backend=deepep needs expert parallelism (ep_size > 1); "
                          "set ep_size to the world or all2all_backend=torch")
    if p.all2all_backend == "deepep":
        sched = rc.scheduler or cluster.scheduler
        # Tokens one rank dispatches per step: decode steps carry one token per running
        # request; prefill (and both) steps carry up to the chunk budget.
        tokens, field = ((sched.max_num_seqs, "max_num_seqs") if role == "decode"
                         else (sched.chunked_prefill_size, "chunked_prefill_size"))
        if tokens > p.deepep_max_tokens_per_rank:
            raise LayoutError(
                f"roles.{role}: a step of up to {tokens} tokens per rank (scheduler.{field}) "
                "exceeds DeepEP's per-GPU capacity "
                f"{where}.deepep_max_tokens_per_rank={p.deepep_max_tokens_per_rank}; such a batch "
                f"is refused, not truncated: lower scheduler.{field} or raise the capacity"
            )
    if hf is not None and p.ep_size > 1:
        experts = _num_experts(hf)
        if experts == 0:
            raise LayoutError(
                f"{where}.ep_size={p.ep_size} but the model has no experts (dense); set ep_size=1"
            )
        if experts % p.ep_size:
            raise LayoutError(
                f"{where}.ep_size={p.ep_size} must divide the model's {experts} experts"
            )


def _num_experts(hf: dict[str, Any]) -> int:
    return next((int(hf[k]) for k in _EXPERT_KEYS if hf.get(k)), 0)


def _check_shapes(role: str, rc: RoleConfig, hf: dict[str, Any]) -> None:
    tp, where = rc.parallel.tp_size, f"roles.{role}.parallel.tp_size"
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % tp:
        raise LayoutError(f"{where}={tp} must divide num_attention_heads={heads}")
    if mla_latent_dim(hf):
        _check_mla(where, tp, hf)
    elif kv_heads % tp and tp % kv_heads:
        raise LayoutError(f"{where}={tp} must divide num_key_value_heads={kv_heads} "
                          "or be a multiple of it (KV heads are then replicated)")
    # A dense MLP is split over its DP group's TP ranks; TP-sharded experts over the whole world.
    world = rc.parallel.world_size
    inter = int(hf.get("intermediate_size") or 0)
    if _num_experts(hf) == 0 and inter and inter % tp:
        raise LayoutError(f"{where}: intermediate_size={inter} must be divisible by tp_size={tp} "
                          "(the MLP is sharded over the TP ranks)")
    # One expert's width: moe_intermediate_size; GPT-OSS's is intermediate_size (all layers MoE).
    gpt_oss_inter = hf.get("intermediate_size") if hf.get("model_type") == "gpt_oss" else 0
    moe_inter = int(hf.get("moe_intermediate_size") or gpt_oss_inter or 0)
    if _num_experts(hf) and rc.parallel.ep_size == 1 and moe_inter and moe_inter % world:
        raise LayoutError(
            f"roles.{role}.parallel: moe_intermediate_size={moe_inter} must be divisible by "
            f"tp_size*dp_size={world} when experts are TP-sharded (ep_size=1); or set "
            f"ep_size={world}"
        )


def _max_model_len(wc: WorkerConfig, hf: dict[str, Any]) -> int:
    """The context a role's requests may reach, from config.json (the worker's formula)."""
    return wc.model.context_len(context_limit(hf))  # RoPE scaling extends it


def _check_step_budget(cluster: ClusterConfig, role: str, hf: dict[str, Any]) -> None:
    """The worker's window rule (`SchedulerConfig.check_window`), before any process starts."""
    wc = worker_config(cluster, role, 0)
    groups = kv_groups(hf, 1, max_model_len=_max_model_len(wc, hf))
    window = next((g.window for g in groups if g.kind == WINDOW), 0)
    try:
        wc.scheduler.check_window(window, wc.cache.page_size)
    except ConfigError as exc:
        raise LayoutError(f"roles.{role}: {exc}") from None


def _check_multi_rank_groups(cluster: ClusterConfig, role: str, rc: RoleConfig,
                             hf: dict[str, Any]) -> None:
    """The worker's rule (worker/cache_layout.py `kv_shape`), before any process starts: window
    rings and recurrent state slots are not mirrored across the ranks of a worker yet."""
    p = rc.parallel
    if p.world_size == 1 and p.nnodes == 1:
        return
    wc = worker_config(cluster, role, 0)
    groups = kv_groups(hf, 1, max_model_len=_max_model_len(wc, hf))
    n, where = int(hf["num_hidden_layers"]), f"roles.{role}.parallel"
    window = next((g for g in groups if g.kind == WINDOW), None)
    if window is not None:
        raise LayoutError(
            f"{where}: a model with sliding-window layers ({len(window.layers)} of {n}, window "
            f"{window.window}) keeps window rings that multi-rank workers do not mirror yet; "
            "run it with tp_size=1 and dp_size=1")
    state = next((g for g in groups if g.kind == RECURRENT), None)
    if state is not None:
        raise LayoutError(
            f"{where}: a model with recurrent layers ({len(state.layers)} of {n}) keeps state "
            "slots that multi-rank workers do not mirror yet; run it with tp_size=1 and "
            "dp_size=1")


def _check_mla(where: str, tp: int, hf: dict[str, Any]) -> None:
    """DeepSeek: no kv heads to split (the latent is replicated); its dense layers and shared
    experts are SwiGLUs split over the attention TP ranks."""
    inter = int(hf.get("intermediate_size") or 0)
    if inter % tp:
        raise LayoutError(f"{where}: intermediate_size={inter} must be divisible by tp_size={tp} "
                          "(the first_k_dense_replace dense layers are sharded over the TP ranks)")
    shared = int(hf.get("n_shared_experts") or 0) * int(hf.get("moe_intermediate_size") or 0)
    if shared % tp:
        raise LayoutError(f"{where}: n_shared_experts*moe_intermediate_size={shared} must be "
                          f"divisible by tp_size={tp} (shared experts are split over the TP ranks)")


def _check_dist_init(role: str, rc: RoleConfig, replica: int) -> None:
    if rc.parallel.nnodes == 1:
        return
    addr = dist_init_addr(rc, replica)
    where = f"roles.{role}.parallel.dist_init_addr"
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not port.isdigit():
        raise LayoutError(f"{where}={addr!r}: must be tcp://HOST:PORT of the replica's node 0")
    node0 = rc.host_of(replica)
    if host != node0 and node0 not in ("0.0.0.0", ""):
        raise LayoutError(
            f"{where}={addr!r} is not on replica {replica}'s node 0 ({node0}): the rendezvous runs "
            "on node 0; leave it empty (node 0's host, port + 1) or name node 0's host"
        )


def kv_budget(cluster: ClusterConfig, hf: dict[str, Any],
              cuda: CudaStatus | None = None) -> list[KVBudget]:
    """Pages and bytes per page for each role, from the HF config.json `hf`."""
    cuda = cuda or cuda_status()
    dtype = _kv_dtype(cluster, hf)
    if dtype not in _DTYPE_BYTES:
        raise ClusterConfigError(f"model.dtype: cannot size a KV cache of dtype {dtype!r}; "
                                 "set model.dtype to float32 or bfloat16")
    check_layout(cluster, hf, cuda)
    out: list[KVBudget] = []
    for role, rc in cluster.roles.present():
        tp = rc.parallel.tp_size
        wc = worker_config(cluster, role, 0)
        cache = wc.cache
        kv_dtype, item = _KV_CACHE_DTYPES.get(cache.kv_cache_dtype, (dtype, _DTYPE_BYTES[dtype]))
        drafts = drafter_kv_layers(wc.speculative, cluster.model.path)
        groups = tuple(kv_groups(hf, item, tp, _max_model_len(wc, hf),
                                 state_dtype_bytes=_DTYPE_BYTES[dtype], draft_layers=drafts))
        # Each DP group holds its own pool of num_pages pages: the replica's bytes scale with dp.
        paged = next(g for g in groups if g.kind in (FULL, MLA))
        page_bytes = paged.bytes_per_token * cache.page_size
        window = next((g for g in groups if g.kind == WINDOW), None)
        window_bytes = 0
        if window is not None:  # rings for every seat, twice over (see _WINDOW_RINGS_PER_SEQ)
            seats = _WINDOW_RINGS_PER_SEQ * wc.scheduler.max_num_seqs * rc.parallel.dp_size
            ring_page = window.bytes_per_token * cache.page_size
            window_bytes = window.ring_pages(cache.page_size) * seats * ring_page
        num_pages = cache.total_pages * rc.parallel.dp_size
        state = next((g for g in groups if g.kind == RECURRENT), None)
        state_bytes = 0
        if state is not None:  # worker/cache_layout.py: state_slots (requests + snapshots)
            slots = _STATE_SLOTS_PER_SEQ * wc.scheduler.max_num_seqs * rc.parallel.dp_size
            state_bytes = slots * state.bytes_per_request
        weights = weight_bytes(cluster.model.path, hf, dtype, device_for(cluster, role, 0, cuda))
        out.append(KVBudget(role, cache.page_size, num_pages, page_bytes, kv_dtype, groups,
                            window_bytes, state_bytes, tp, weights, wc.speculative.method))
    return out


def preflight(cluster: ClusterConfig) -> list[str]:
    """What a launcher checks before it starts a process: the checkpoint, then every layout
    rule (devices included) against its config.json. Returns notes for the user (e.g. token-id
    mode); raises CheckpointError / LayoutError (both ClusterConfigError) with one line."""
    report = check_checkpoint(cluster.model.path, cluster.model.load_format)
    cuda = cuda_status()
    check_layout(cluster, report.config, cuda)
    check_drafter(cluster, report.path, report.arch)
    check_host_memory(cluster, kv_budget(cluster, report.config, cuda), cuda)
    notes = []
    if not report.has_tokenizer:
        notes.append(f"note: {report.path} has no tokenizer files: the gateway takes token-id "
                     "prompts on /v1/completions only (text prompts and chat get a 400)")
    try:
        defaults = load_sampling_defaults(str(report.path), cluster.gateway.generation_config)
    except GatewayConfigError as exc:
        raise ClusterConfigError(str(exc)) from exc
    if defaults:
        notes.append(f"note: generation_config.json sets the sampling a request leaves out: "
                     f"{describe(defaults)} (gateway.generation_config: none ignores it)")
    return notes
