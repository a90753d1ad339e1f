"""orchestrator/launch/ports.py: a host that does not resolve is named as such, not as a busy
port (a typo in gateway.host or a role's host used to read "port N is in use ... another
cluster?")."""

from __future__ import annotations

import pytest

from orchestrator.config import ClusterConfigError, config_from_dict
from orchestrator.launch.ports import (
    PortInUseError,
    check_ports,
    is_free,
    require_pinned,
    resolve_ports,
)


def test_an_unresolvable_host_is_refused_naming_the_host_not_a_busy_port() -> None:
    with pytest.raises(ClusterConfigError, match=r"999\.1\.1\.1.*does not resolve") as info:
        is_free("999.1.1.1", 8311)
    assert not isinstance(info.value, PortInUseError)
    cluster = config_from_dict({"gateway": {"host": "999.1.1.1", "port": 8311},
                                "roles": {"both": {"count": 1}}})
    with pytest.raises(ClusterConfigError, match=r"gateway\.host.*999\.1\.1\.1.*does not resolve"):
        check_ports(cluster)
    unset = config_from_dict({"roles": {"prefill": {"count": 1},
                                        "decode": {"count": 1, "host": "no-such-host.invalid"}}})
    with pytest.raises(ClusterConfigError, match=r"^roles\.decode\.host: host 'no-such-host"):
        resolve_ports(unset)  # a free port is chosen on it: the same line, not "no free ports"


def test_unpinned_worker_ports_are_refused_naming_every_role_and_the_fix() -> None:
    """Ray and Slurm dial workers on other nodes: every unset base_port is named at once, with
    --set lines that pin them (one refusal per role used to take one run per role to find)."""
    cluster = config_from_dict({"roles": {"prefill": {"count": 2}, "decode": {"count": 1}}})
    with pytest.raises(ClusterConfigError) as info:
        require_pinned(cluster, "ray")
    line = str(info.value)
    assert "\n" not in line
    assert "roles.prefill.base_port and roles.decode.base_port are unset" in line
    assert "the ray launcher" in line
    # The suggested ports leave room for prefill's two replicas (port_stride 10).
    assert "--set roles.prefill.base_port=50051 --set roles.decode.base_port=50071" in line
    fixed = config_from_dict({"roles": {"prefill": {"count": 2, "base_port": 50051},
                                        "decode": {"count": 1, "base_port": 50071}}})
    require_pinned(fixed, "ray")  # the suggestion is accepted as is
    half = config_from_dict({"roles": {"prefill": {"base_port": 50051}, "decode": {}}})
    with pytest.raises(ClusterConfigError, match=r"^roles\.decode\.base_port is unset: the slurm.*"
                       r"--set roles\.decode\.base_port=50061$"):
        require_pinned(half, "slurm")
