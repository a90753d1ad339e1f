"""The cross-field rules of the cluster config (`ClusterConfig.validate` calls them).

Each raises ClusterConfigError with one line that names the field, the value and the fix.
Kept apart from orchestrator/config.py (the tree itself) so that file stays one idea.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.config import ClusterConfig

# Hosts a listening socket binds to that a client must not dial as such.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class ClusterConfigError(ValueError):
    """The cluster config is wrong; the message names the field (and the file) and the fix."""


def validate_roles(cluster: ClusterConfig) -> None:
    roles = cluster.roles
    if roles.both is not None and (roles.prefill is not None or roles.decode is not None):
        raise ClusterConfigError(
            "roles: give either `both` (monolithic) or `prefill` and `decode` (disaggregated), "
            "not both kinds"
        )
    if roles.both is None and (roles.prefill is None or roles.decode is None):
        missing = "prefill" if roles.prefill is None else "decode"
        raise ClusterConfigError(
            "roles: disaggregated serving needs both `prefill` and `decode`; "
            f"`{missing}` is missing. "
            f"Add roles.{missing}, or use a single roles.both for monolithic serving"
        )
    for name, rc in roles.present():
        where = f"roles.{name}"
        if rc.count < 1:
            raise ClusterConfigError(
                f"{where}.count must be >= 1, got {rc.count} (remove the role instead)"
            )
        if rc.port_stride < 0:
            raise ClusterConfigError(
                f"{where}.port_stride must be >= 0 (0 = every replica on base_port, "
                f"each on its own host), got {rc.port_stride}"
            )
        if rc.base_port < 0 or rc.port(rc.count - 1) > 65535:
            raise ClusterConfigError(
                f"{where}: ports {rc.base_port}..{rc.port(rc.count - 1)} leave 1..65535; "
                "lower base_port or port_stride"
            )
        if rc.parallel.tp_size < 1:
            raise ClusterConfigError(
                f"{where}.parallel.tp_size must be >= 1, got {rc.parallel.tp_size}"
            )
        if rc.hosts and len(rc.hosts) != rc.count:
            raise ClusterConfigError(
                f"{where}.hosts lists {len(rc.hosts)} hosts for count={rc.count} replicas; "
                "give one host per replica or leave it empty"
            )
        for fname in ("dp_size", "ep_size", "nnodes", "deepep_max_tokens_per_rank"):
            if getattr(rc.parallel, fname) < 1:
                raise ClusterConfigError(
                    f"{where}.parallel.{fname} must be >= 1, got {getattr(rc.parallel, fname)}"
                )
        if rc.parallel.procs_per_node < 0:
            raise ClusterConfigError(
                f"{where}.parallel.procs_per_node must be >= 0 (0 = world / nnodes), "
                f"got {rc.parallel.procs_per_node}"
            )
        dev = rc.parallel.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ClusterConfigError(
                f"{where}.parallel.device must be auto, cpu, cuda or cuda:N, got {dev!r}"
            )
        if rc.num_threads < 0:
            raise ClusterConfigError(
                f"{where}.num_threads must be >= 0 (0 = torch's default), got {rc.num_threads}"
            )
        if rc.drain_timeout_s <= 0:
            raise ClusterConfigError(
                f"{where}.drain_timeout_s must be > 0 seconds, got {rc.drain_timeout_s}"
            )


# Cache fields of the layout contract: prefill writes KV into decode's pages as they are.
_PAIRED_CACHE_FIELDS = ("page_size", "kv_cache_dtype")


def validate_page_pairing(cluster: ClusterConfig) -> None:
    """Prefill and decode agree on what a page is; a role's own cache section may differ in the
    rest (num_pages, enable_prefix_cache). Else the gateway refuses decode's contract at run
    time, after the launch."""
    prefill, decode = cluster.roles.prefill, cluster.roles.decode
    if prefill is None or decode is None:
        return
    p_cache, d_cache = prefill.cache or cluster.cache, decode.cache or cluster.cache
    for name in _PAIRED_CACHE_FIELDS:
        pv, dv = getattr(p_cache, name), getattr(d_cache, name)
        if pv != dv:
            raise ClusterConfigError(
                f"roles.decode.cache.{name}={dv} differs from roles.prefill's {pv}: prefill "
                f"writes the KV into decode's pages as they are, so both roles need one {name}; "
                "set it once in the top-level cache section (or the same in both roles)"
            )


def validate_across_sections(cluster: ClusterConfig) -> None:
    """The rules across sections, once every section is valid on its own."""
    validate_page_pairing(cluster)
    validate_launcher_and_eval(cluster)
    validate_ports(cluster)


def validate_launcher_and_eval(cluster: ClusterConfig) -> None:
    if cluster.launcher.ready_timeout_s <= 0:
        raise ClusterConfigError(
            f"launcher.ready_timeout_s must be > 0, got {cluster.launcher.ready_timeout_s}"
        )
    if cluster.launcher.stop_grace_s < 0:
        raise ClusterConfigError(
            f"launcher.stop_grace_s must be >= 0, got {cluster.launcher.stop_grace_s}"
        )
    for name, zero in (("log_tail_lines", "no lines"), ("max_restarts", "no restarts"),
                       ("gpus_per_node", "unchecked")):
        if getattr(cluster.launcher, name) < 0:
            raise ClusterConfigError(f"launcher.{name} must be >= 0 (0 = {zero}), "
                                     f"got {getattr(cluster.launcher, name)}")
    ev = cluster.eval
    from orchestrator.tasks import TASKS  # pure Python, no server code

    if ev.task not in TASKS:
        raise ClusterConfigError(
            f"eval.task must be one of {' | '.join(TASKS)}, got {ev.task!r}"
        )
    if ev.samples < 1 or ev.concurrency < 1:
        raise ClusterConfigError(
            f"eval.samples and eval.concurrency must be >= 1, got {ev.samples} and {ev.concurrency}"
        )
    if not 0.0 <= ev.min_accuracy <= 1.0:
        raise ClusterConfigError(f"eval.min_accuracy must be within 0..1, got {ev.min_accuracy}")
    if not 1 <= cluster.gateway.port <= 65535:
        raise ClusterConfigError(
            f"gateway.port must be within 1..65535, got {cluster.gateway.port}"
        )


def same_host(a: str, b: str) -> bool:
    norm = {"localhost": "127.0.0.1"}
    a, b = norm.get(a, a), norm.get(b, b)
    return a == b or a in WILDCARD_HOSTS or b in WILDCARD_HOSTS


def validate_ports(cluster: ClusterConfig) -> None:
    """No two listeners (gateway, every worker replica) on the same host:port."""
    taken: list[tuple[str, int, str]] = [
        (cluster.gateway.host, cluster.gateway.port, "gateway.port")
    ]
    for name, rc in cluster.roles.present():
        for i in range(rc.count if rc.base_port else 0):  # unpinned: chosen free at launch
            taken.append((rc.host_of(i), rc.port(i), f"roles.{name} replica {i}"))
    for j, (host, port, who) in enumerate(taken):
        for host2, port2, who2 in taken[:j]:
            if port == port2 and same_host(host, host2):
                raise ClusterConfigError(
                    f"port collision: {who} and {who2} both use {host}:{port}. "
                    "Change a role's base_port / port_stride or gateway.port"
                )
