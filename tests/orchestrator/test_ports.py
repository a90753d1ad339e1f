"""orchestrator/launch/ports.py: a host that does not resolve is named as such, not as a busy
port (a typo in gateway.host or a role's host used to read "port N is in use ... another
cluster?")."""

from __future__ import annotations

import pytest

from orchestrator.config import ClusterConfigError, config_from_dict
from orchestrator.launch.ports import PortInUseError, check_ports, is_free, resolve_ports


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
