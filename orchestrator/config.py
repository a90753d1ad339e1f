"""The cluster config tree: one YAML file describes a whole deployment.

    ClusterConfig
      model      ModelConfig        (worker/config.py) which checkpoint, dtype, served name
      cache      CacheConfig        (worker/config.py) KV pages; a role may override fields
      scheduler  SchedulerConfig    (worker/config.py) batch limits; a role may override fields
      transfer   TransferConfig     (transfer/config.py) KV transfer backend and deadlines
      gateway    GatewaySettings    HTTP host/port, routing policies, api key, health thresholds
      roles      RolesConfig        prefill + decode (PD) or a single `both` (monolithic)
      launcher   LauncherConfig     local | slurm | ray, log dir, readiness deadline
      eval       EvalGate           the accuracy gate `tandem eval` applies by default
      speculative SpeculativeConfig (worker/config.py) drafts verified by decode and mono workers

Frozen dataclasses, composed. `load_config` reads YAML, applies `--set a.b=c` overrides, and
validates every part plus the cross-field rules. `gateway_config` derives the gateway's
config (orchestrator/worker_config.py the workers'). This module imports only the
config types of the other packages, never their internals.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from gateway.config import GatewayConfig, GatewayConfigError, Policy
from orchestrator.config_checks import (
    WILDCARD_HOSTS,
    ClusterConfigError,
    validate_across_sections,
    validate_roles,
)
from orchestrator.config_yaml import read_yaml
from orchestrator.hub import (
    HubModelError,
    looks_like_repo_id,
    resolve_repo_id,
    split_revision,
)
from orchestrator.schema import (
    SchemaError,
    apply_override,
    build,
    merge_role_sections,
    parse_override,
    partial_role_sections,
    to_plain,
)
from protocol.tls import TLSConfig, TLSConfigError
from transfer.config import TransferConfig, TransferConfigError
from worker.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny-1p1d.yaml"


def resolve_config_path(path: str | None) -> Path:
    """--config as given (None: the default config); a relative path missing here is looked up
    in the repository."""
    if path is None:
        return DEFAULT_CONFIG
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


RoleName = Literal["prefill", "decode", "both"]
ROLE_NAMES: tuple[RoleName, ...] = ("prefill", "decode", "both")
LauncherKind = Literal["local", "slurm", "ray"]


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's own settings; worker addresses and the model come from the rest of the tree."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # "" = no auth
    admin_key: str = ""  # /workers (add, drain, list) and /metrics; "" = admin routes off
    metrics_public: bool = False  # /metrics without the admin key (Prometheus scrapers)
    prefill_policy: Policy = "cache_aware"
    decode_policy: Policy = "least_load"  # also the policy of `both` workers
    health_interval_s: float = 1.0
    health_fail_threshold: int = 2  # consecutive failed checks before a worker is unhealthy
    health_ok_threshold: int = 1  # consecutive good checks before it takes requests again
    # a check slower than this fails (a busy worker is not a dead one)
    health_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 60.0
    max_request_bytes: int = 4 * 1024 * 1024
    # bodies being read at once, over all connections (past it: 503 + Retry-After)
    max_body_buffer_bytes: int = 256 * 1024 * 1024
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    retry_before_first_token: bool = True
    stream_stall_timeout_s: float = 10.0  # after the first token: no token this long = error
    max_queued_requests: int = 1024  # held at the gateway while decode is full (then 429)
    queue_timeout_s: float = 300.0  # the longest such wait (then 503)
    header_timeout_s: float = 10.0  # request headers must arrive within this (else 408, close)
    max_header_bytes: int = 64 * 1024  # a request's headers past this: 431 and a close
    keepalive_timeout_s: float = 5.0  # an idle kept-alive connection closes after this
    max_connections: int = 4096  # open at once; past it a new connection gets 503
    load_interval_s: float = 0.5  # GetLoad refresh period (routing and GET /workers)
    startup_wait_s: float = 30.0  # the gateway's own wait for a healthy worker per pool
    cache_aware_load_threshold: float = 8.0
    cache_aware_max_pages: int = 200_000
    log_level: str = "info"
    reasoning_parser: str = "auto"  # auto | none | qwen3 | deepseek_r1 (auto: from the template)
    tool_call_parser: str = "auto"  # auto | none | hermes | qwen3_coder | llama3_json | mistral ...
    generation_config: str = "auto"  # auto: generation_config.json's sampling defaults | none


# GatewayConfig fields that the orchestrator fills from the rest of the tree, not from YAML.
GATEWAY_DERIVED_FIELDS = ("model_path", "served_model_name", "workers", "prefill", "decode", "tls",
                          "cluster_id", "model_fingerprint", "drain_timeout_s")


All2All = Literal["torch", "deepep"]


@dataclass(frozen=True)
class RoleParallel:
    """Parallelism of every replica of one role (ranks are per process, not configured).

    A replica is tp_size * dp_size rank processes (its world) spread evenly over nnodes nodes;
    orchestrator/plan.py checks every rule between these fields and the checkpoint.
    """

    tp_size: int = 1  # attention tensor parallelism
    # auto (cuda where CUDA is usable here, else cpu) | cpu | cuda (GPUs handed out in plan
    # order) | cuda:N (fixed)
    device: str = "auto"
    dp_size: int = 1  # attention data-parallel groups
    ep_size: int = 1  # MoE expert parallelism: 1 (experts TP-sharded) or the world
    all2all_backend: All2All = "torch"  # MoE dispatch/combine; deepep only with ep_size > 1
    nnodes: int = 1  # nodes one replica spans (multi-node workers: Slurm)
    procs_per_node: int = 0  # rank processes (GPUs) per node; 0 = world / nnodes
    dist_init_addr: str = ""  # tcp://HOST:PORT on the replica's node 0; "" = its host, port + 1
    # DeepEP's buffers hold this many dispatched tokens per rank; a bigger step is refused.
    deepep_max_tokens_per_rank: int = 128

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


@dataclass(frozen=True)
class RoleConfig:
    """One pool of identical workers. Replica i listens on base_port + i * port_stride
    (port_stride 0: all on base_port, which needs a host per replica in `hosts`).
    base_port 0 (unset): the local launcher picks free ports; Slurm and Ray need it set."""

    count: int = 1
    host: str = "127.0.0.1"
    # Per-replica hosts (bind and dial) overriding `host`; launchers that spread replicas over
    # nodes (Slurm) fill it. Empty = every replica on `host`.
    hosts: tuple[str, ...] = ()
    base_port: int = 0
    port_stride: int = 10  # > 1 leaves room for a worker's side ports (e.g. bootstrap)
    drain_timeout_s: float = 30.0  # a draining worker finishes its requests within this
    parallel: RoleParallel = field(default_factory=RoleParallel)
    num_threads: int = 0  # torch intra-op threads per worker; 0 = torch's default
    # Per-role overrides: the YAML gives only the fields that differ; load_config merges them
    # over the cluster's section, so a non-None value here is complete. None = the cluster's.
    cache: CacheConfig | None = None
    scheduler: SchedulerConfig | None = None

    def port(self, replica: int) -> int:
        """The replica's gRPC port; 0 while unpinned (the local launcher resolves it)."""
        return self.base_port + replica * self.port_stride if self.base_port else 0

    def host_of(self, replica: int) -> str:
        return self.hosts[replica] if self.hosts else self.host


@dataclass(frozen=True)
class RolesConfig:
    """PD serving names `prefill` and `decode`; monolithic serving names only `both`."""

    prefill: RoleConfig | None = None
    decode: RoleConfig | None = None
    both: RoleConfig | None = None

    def present(self) -> list[tuple[RoleName, RoleConfig]]:
        """The configured roles in launch order."""
        return [(name, rc) for name in ROLE_NAMES if (rc := getattr(self, name)) is not None]

    @property
    def is_pd(self) -> bool:
        return self.both is None


@dataclass(frozen=True)
class LauncherConfig:
    kind: LauncherKind = "local"
    log_dir: str = "logs"  # a run directory per cluster inside: logs/<gateway port>/
    run_dir: str = ""  # "" = <log_dir>/<gateway port>: cluster.yaml, prefill-0.log, lb.log
    cluster_id: str = ""  # "" = drawn at each launch; workers report it and must match it
    ready_timeout_s: float = 300.0  # from start until every worker's gRPC health says SERVING
    stop_grace_s: float = 10.0  # SIGTERM → SIGKILL
    log_tail_lines: int = 40  # lines of a failed process's log printed on failure
    # A worker that exits: `stop` ends the cluster; `restart` starts it again on the same port
    # (the gateway routes around it meanwhile) up to max_restarts times.
    on_worker_exit: Literal["stop", "restart"] = "stop"
    max_restarts: int = 3
    # GPUs of one node (plan checks procs_per_node against it); 0 = unchecked
    gpus_per_node: int = 0
    # Slurm and Ray: node 0 runs the eval gate (the `eval` section) against the gateway once it
    # is ready, then stops the cluster and exits with the gate's result. False = serve on.
    eval_on_ready: bool = False
    artifact_dir: str = "artifacts"  # Slurm: on the shared filesystem; one unique run dir inside
    slurm_partition: str = ""  # "" = the cluster's default partition
    slurm_time_limit: str = "00:30:00"
    ray_address: str = ""  # Ray: "" = start a local Ray instance; else ray://... or host:port


@dataclass(frozen=True)
class EvalGate:
    """Defaults of `tandem eval` when a config is given (the CI gate's bar)."""

    task: str = "arith"
    samples: int = 200
    concurrency: int = 8
    min_accuracy: float = 0.9
    seed: int = 1234


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    roles: RolesConfig = field(default_factory=RolesConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    eval: EvalGate = field(default_factory=EvalGate)
    # every gRPC link (off: plaintext on loopback)
    tls: TLSConfig = field(default_factory=TLSConfig)
    # Decode and mono workers draft and verify; prefill workers ship what the drafter needs.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def role(self, name: str) -> RoleConfig:
        rc = getattr(self.roles, name, None) if name in ROLE_NAMES else None
        if rc is None:
            have = ", ".join(n for n, _ in self.roles.present())
            raise ClusterConfigError(
                f"role '{name}' is not in this config's roles (it has: {have})"
            )
        return rc

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or Path(self.model.path).name

    def validate(self) -> None:
        """Every part's own validate(), then the cross-field rules."""
        try:
            self.model.validate("model")
            self.cache.validate("cache")
            self.scheduler.validate("scheduler")
            self.transfer.validate("transfer")
            validate_roles(self)
            for name, rc in self.roles.present():
                if rc.cache is not None:
                    rc.cache.validate(f"roles.{name}.cache")
                if rc.scheduler is not None:
                    rc.scheduler.validate(f"roles.{name}.scheduler")
                where = "scheduler" if rc.scheduler is None else f"roles.{name}.scheduler"
                (rc.scheduler or self.scheduler).check_overlap(
                    rc.parallel.world_size > 1 or rc.parallel.nnodes > 1,
                    self.speculative.enabled, where)
            gateway_config(self, resolved=False).validate("gateway")
            self.tls.validate("tls")
            self.speculative.validate("speculative")
        except (ConfigError, TransferConfigError, GatewayConfigError, TLSConfigError) as exc:
            raise ClusterConfigError(str(exc)) from None
        validate_across_sections(self)


def _resolve_model_path(model: ModelConfig) -> ModelConfig:
    """A relative model path means the current directory, else the repository (embedded
    model), else a Hugging Face name (ORG/NAME) in the local cache, served under that name.
    Not found anywhere: left as written, for the launcher's check to name where it looked."""
    p = Path(model.path)
    if p.is_absolute():
        return model
    for root in (Path.cwd(), REPO_ROOT):
        if (root / p).exists():
            return dataclasses.replace(model, path=str((root / p).resolve()))
    if looks_like_repo_id(model.path):
        try:
            snapshot = resolve_repo_id(model.path)
        except HubModelError:
            return model
        name = model.served_model_name or split_revision(model.path)[0]
        return dataclasses.replace(model, path=str(snapshot), served_model_name=name)
    return model


def _build(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> ClusterConfig:
    """The validated tree of `data` with `overrides` applied; SchemaError or ClusterConfigError."""
    data = _deep_copy(data)
    for text in overrides:
        keys, value = parse_override(text, ClusterConfig)
        apply_override(data, keys, value)
    merge_role_sections(data)
    cluster: ClusterConfig = build(ClusterConfig, data)
    cluster = dataclasses.replace(cluster, model=_resolve_model_path(cluster.model))
    cluster.validate()
    return cluster


def _key_of(override: str) -> str:
    return override.partition("=")[0].strip()


def _in_force(overrides: list[str]) -> list[str]:
    """The last override of each key (the one whose value the config holds), in order."""
    last = {_key_of(t): i for i, t in enumerate(overrides)}
    return [t for i, t in enumerate(overrides) if last[_key_of(t)] == i]


def _names_key(message: str, key: str) -> bool:
    """The error message names the dotted key (or a field under it)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message) is not None


def _culprits(data: dict[str, Any], overrides: list[str] | tuple[str, ...], message: str,
              ) -> list[str]:
    """The --set lines to blame for a rule the config breaks: those whose key the message
    names, else each one without which the config is valid; [] = the file's own doing."""
    named = [t for t in overrides if _names_key(message, _key_of(t))]
    if named:
        return named
    blamed = []
    for i, text in enumerate(overrides):
        try:
            _build(data, [*overrides[:i], *overrides[i + 1:]])
        except (SchemaError, ClusterConfigError):
            continue
        blamed.append(text)
    return blamed


def config_from_dict(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = ""
) -> ClusterConfig:
    """Build and validate a ClusterConfig from a YAML-shaped mapping plus `a.b=c` overrides.

    An error names where it comes from: the `--set` that caused it, else `source` (the file)."""
    try:
        return _build(data, overrides)
    except SchemaError as exc:
        message = str(exc)
        if message.startswith("--set "):  # a malformed --set names itself
            raise ClusterConfigError(message) from None
        culprits = [t for t in overrides if message.startswith(f"{_key_of(t)}:")]
    except ClusterConfigError as exc:
        message = str(exc)
        culprits = _culprits(data, overrides, message)
    where = ", ".join(f"--set {t!r}" for t in _in_force(culprits)) or source
    raise ClusterConfigError(f"{where}: {message}" if where else message) from None


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ClusterConfig:
    """Load a cluster YAML file, apply `--set` overrides (`a.b=c`), validate, return the tree."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a YAML file" if p.is_dir() else "not found"
        raise ClusterConfigError(
            f"config file {str(p)!r} {what}; pass --config PATH (e.g. {DEFAULT_CONFIG})"
        )
    data = read_yaml(p) or {}
    if not isinstance(data, dict):
        raise ClusterConfigError(
            f"{p}: the top level must be a mapping of sections (model, roles, ...)"
        )
    roles = data.get("roles")  # `prefill:` with nothing under it (`--set roles.R=null` removes)
    for name in ROLE_NAMES:
        if isinstance(roles, dict) and name in roles and roles[name] is None:
            raise ClusterConfigError(
                f"{p}: roles.{name}: has no keys (null); write `{name}: {{}}` for the defaults, "
                "or give its keys")
    return config_from_dict(data, overrides, source=str(p))


def dump_config(cluster: ClusterConfig) -> str:
    """The resolved tree as YAML that `load_config` reads back to an equal ClusterConfig (a
    role's own sections keep only what differs: overrides reach the rest, as from the file)."""
    return yaml.safe_dump(partial_role_sections(to_plain(cluster)), sort_keys=False)


def dial_address(host: str, port: int) -> str:
    """host:port a client dials; a wildcard bind address is reached over loopback."""
    return f"{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"


def worker_addresses(cluster: ClusterConfig, role: str, resolved: bool = True) -> tuple[str, ...]:
    """host:port of every replica; `resolved`: ClusterConfigError while a port is unpinned."""
    rc = getattr(cluster.roles, role)
    if rc is None:
        return ()
    if resolved and not rc.base_port:
        raise ClusterConfigError(
            f"roles.{role}.base_port is unset (0): only the local launcher (`tandem serve`) picks "
            f"free ports; set roles.{role}.base_port for a gateway or launcher that dials it")
    return tuple(dial_address(rc.host_of(i), rc.port(i)) for i in range(rc.count))


def gateway_config(cluster: ClusterConfig, resolved: bool = True) -> GatewayConfig:
    """The GatewayConfig: the gateway section plus model and worker addresses from the roles.

    `resolved`: the worker ports must be pinned (the gateway dials them); False only to
    validate a config whose ports the local launcher has yet to choose.
    """
    from protocol.identity import model_fingerprint

    # Only the fields GatewayConfig has: a setting the gateway dropped must not break loading.
    accepted = {f.name for f in dataclasses.fields(GatewayConfig)}
    settings = {
        f.name: getattr(cluster.gateway, f.name)
        for f in dataclasses.fields(GatewaySettings)
        if f.name in accepted
    }
    return GatewayConfig(
        **settings,
        model_path=cluster.model.path,
        served_model_name=cluster.served_model_name,
        workers=worker_addresses(cluster, "both", resolved),
        prefill=worker_addresses(cluster, "prefill", resolved),
        decode=worker_addresses(cluster, "decode", resolved),
        tls=cluster.tls,
        cluster_id=cluster.launcher.cluster_id,
        model_fingerprint=model_fingerprint(cluster.served_model_name, cluster.model.path,
                                            cluster.model.load_format, cluster.model.seed),
        drain_timeout_s=max(rc.drain_timeout_s for _, rc in cluster.roles.present()),
    )
