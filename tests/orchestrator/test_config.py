"""The cluster config tree: loading, every rejection message, overrides, derived configs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from gateway.config import GatewayConfig
from orchestrator.config import (
    GATEWAY_DERIVED_FIELDS,
    REPO_ROOT,
    ClusterConfig,
    ClusterConfigError,
    GatewaySettings,
    config_from_dict,
    dump_config,
    gateway_config,
    load_config,
)
from orchestrator.worker_config import worker_config

CONFIGS = REPO_ROOT / "configs"
PD = {"roles": {"prefill": {"base_port": 51000}, "decode": {"base_port": 52000}}}


def write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("name", ["tiny-1p1d", "tiny-mono", "tiny-2p2d"])
def test_shipped_configs_load_and_round_trip(name: str) -> None:
    cluster = load_config(CONFIGS / f"{name}.yaml")
    assert config_from_dict(yaml.safe_load(dump_config(cluster))) == cluster


def test_default_config_is_1p1d_tcp_mooncake_without_decode_prefix_cache() -> None:
    c = load_config(CONFIGS / "tiny-1p1d.yaml")
    assert c.roles.is_pd and c.roles.prefill and c.roles.decode and c.roles.both is None
    assert (c.roles.prefill.count, c.roles.decode.count) == (1, 1)
    assert (c.transfer.backend, c.transfer.protocol) == ("mooncake", "tcp")
    assert (c.gateway.host, c.gateway.port) == ("127.0.0.1", 8000)
    assert c.model.path.endswith("models/tandem-arith")
    assert worker_config(c, "decode").cache.enable_prefix_cache is False
    assert worker_config(c, "prefill").cache.enable_prefix_cache is True


def test_unknown_key_names_it_lists_valid_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, {**PD, "cache": {"page_sise": 32}})
    with pytest.raises(ClusterConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg and "unknown key 'page_sise' in 'cache'" in msg
    assert "Valid keys: page_size, num_pages, max_total_tokens, enable_prefix_cache" in msg
    assert "Did you mean 'page_size'?" in msg


def test_unknown_top_level_and_nested_role_keys() -> None:
    with pytest.raises(
        ClusterConfigError, match=r"unknown key 'rolez' at the top level.*Did you mean 'roles'"
    ):
        config_from_dict({**PD, "rolez": {}})
    with pytest.raises(
        ClusterConfigError, match=r"unknown key 'tp' in 'roles.decode.parallel'.*tp_size"
    ):
        config_from_dict(
            {
                "roles": {
                    "prefill": {"base_port": 51000},
                    "decode": {"base_port": 52000, "parallel": {"tp": 2}},
                }
            }
        )


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            {"roles": {"prefill": {"count": "two"}}},
            r"roles.prefill.count: expected int, got 'two' \(str\)",
        ),
        ({"roles": {"prefill": {"count": True}}}, r"roles.prefill.count: expected int, got True"),
        (
            {"cache": {"enable_prefix_cache": "no"}},
            r"cache.enable_prefix_cache: expected bool \(true or false\), got 'no'",
        ),
        (
            {"transfer": {"waiting_timeout_s": "soon"}},
            r"transfer.waiting_timeout_s: expected float",
        ),
        ({"model": "models/x"}, r"model: expected a mapping"),
    ],
)
def test_wrong_type_names_field_type_and_value(data: dict, pattern: str) -> None:
    with pytest.raises(ClusterConfigError, match=pattern):
        config_from_dict(data)


def test_bad_enum_lists_choices_and_suggests() -> None:
    with pytest.raises(
        ClusterConfigError,
        match=r"transfer.backend: must be one of mooncake \| nixl \| cuda_ipc, got 'nixel'"
        r".*Did you mean 'nixl'",
    ):
        config_from_dict({**PD, "transfer": {"backend": "nixel"}})
    with pytest.raises(
        ClusterConfigError,
        match=r"gateway.prefill_policy: must be one of round_robin \| least_load \| cache_aware",
    ):
        config_from_dict({**PD, "gateway": {"prefill_policy": "random"}})
    with pytest.raises(
        ClusterConfigError, match=r"launcher.kind: must be one of local \| slurm \| ray"
    ):
        config_from_dict({**PD, "launcher": {"kind": "k8s"}})


def test_port_collisions() -> None:
    with pytest.raises(
        ClusterConfigError,
        match=r"port collision: roles.decode replica 0 and roles.prefill replica 1 "
        r"both use 127.0.0.1:50061",
    ):
        config_from_dict(
            {"roles": {"prefill": {"count": 2, "base_port": 50051}, "decode": {"base_port": 50061}}}
        )
    with pytest.raises(
        ClusterConfigError, match=r"port collision: roles.prefill replica 0 and gateway.port"
    ):
        config_from_dict(
            {"roles": {"prefill": {"base_port": 8000}, "decode": {"base_port": 52000}}}
        )
    # Different hosts may reuse a port.
    config_from_dict(
        {
            "roles": {
                "prefill": {"base_port": 51000, "host": "10.0.0.1"},
                "decode": {"base_port": 51000, "host": "10.0.0.2"},
            }
        }
    )


def test_missing_or_mixed_roles() -> None:
    with pytest.raises(
        ClusterConfigError, match=r"needs both `prefill` and `decode`; `decode` is missing"
    ):
        config_from_dict({"roles": {"prefill": {}}})
    with pytest.raises(ClusterConfigError, match=r"`prefill` is missing"):
        config_from_dict({})
    with pytest.raises(ClusterConfigError, match=r"either `both` .* not both kinds"):
        config_from_dict({"roles": {"both": {}, "prefill": {"base_port": 51000}}})


def test_part_validation_is_called_with_field_names() -> None:
    with pytest.raises(
        ClusterConfigError,
        match=r"roles.decode.cache.page_size must be a positive power of two, got 12",
    ):
        config_from_dict(
            {
                "roles": {
                    "prefill": {"base_port": 51000},
                    "decode": {"base_port": 52000, "cache": {"page_size": 12}},
                }
            }
        )
    with pytest.raises(
        ClusterConfigError, match=r"scheduler.chunked_prefill_size \(8\) must be >= max_num_seqs"
    ):
        config_from_dict({**PD, "scheduler": {"chunked_prefill_size": 8}})
    with pytest.raises(ClusterConfigError, match=r"roles.prefill.count must be >= 1"):
        config_from_dict({"roles": {"prefill": {"count": 0}, "decode": {"base_port": 52000}}})
    with pytest.raises(ClusterConfigError,
                       match=r"roles.decode.parallel.device must be auto, cpu, cuda or cuda:N"):
        config_from_dict(
            {
                "roles": {
                    "prefill": {"base_port": 51000},
                    "decode": {"base_port": 52000, "parallel": {"device": "gpu"}},
                }
            }
        )


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(
        ClusterConfigError, match=r"config file .*nope.yaml' not found; pass --config PATH"
    ):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ClusterConfigError, match=r"is a directory, not a YAML file; pass --config"):
        load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("roles: [unclosed\n")
    with pytest.raises(ClusterConfigError) as info:
        load_config(bad)
    # one line: the file, line and column, and what is wrong there
    assert re.fullmatch(rf"{re.escape(str(bad))}:\d+:\d+: not valid YAML: [^\n]+",
                        str(info.value)), str(info.value)


def test_overrides_are_typed_like_yaml() -> None:
    c = load_config(
        CONFIGS / "tiny-1p1d.yaml",
        [
            "roles.decode.count=2",
            "transfer.backend=nixl",
            "transfer.checksum=true",
            "transfer.waiting_timeout_s=5",
            "model.served_model_name=007",
            "cache.page_size=32",
        ],
    )
    assert c.roles.decode is not None and c.roles.decode.count == 2
    assert (
        c.transfer.backend == "nixl"
        and c.transfer.checksum is True
        and c.transfer.waiting_timeout_s == 5.0
    )
    assert c.served_model_name == "007"  # a string field keeps the raw text
    # The cluster cache override reaches a role with its own cache section (merged under it).
    assert worker_config(c, "decode", 1).cache.page_size == 32
    assert worker_config(c, "decode", 1).cache.enable_prefix_cache is False


def test_override_errors() -> None:
    with pytest.raises(
        ClusterConfigError,
        match=r"--set 'roles.decode.cout=2': unknown key 'cout' in 'roles.decode'"
        r".*Did you mean 'count'",
    ):
        load_config(CONFIGS / "tiny-1p1d.yaml", ["roles.decode.cout=2"])
    with pytest.raises(ClusterConfigError, match=r"expected KEY=VALUE"):
        load_config(CONFIGS / "tiny-1p1d.yaml", ["roles.decode.count"])
    with pytest.raises(ClusterConfigError, match=r"^--set 'roles.decode.count=many': "
                       r"roles.decode.count: expected int, got 'many'"):
        load_config(CONFIGS / "tiny-1p1d.yaml", ["roles.decode.count=many"])
    with pytest.raises(
        ClusterConfigError, match=r"'gateway.port' is a value \(int\), it has no key 'x'"
    ):
        load_config(CONFIGS / "tiny-1p1d.yaml", ["gateway.port.x=1"])


def test_worker_config_derivation() -> None:
    c = load_config(
        CONFIGS / "tiny-2p2d.yaml",
        [
            "transfer.backend=nixl",
            "roles.decode.num_threads=2",
            "roles.decode.base_port=50151",
            "launcher.cluster_id=c1",
        ],
    )
    w = worker_config(c, "decode", 1)
    assert (w.role, w.host, w.port) == ("decode", "127.0.0.1", 50161)
    assert (w.cluster_id, w.replica, w.drain_timeout_s) == ("c1", 1, 30.0)  # what GetInfo reports
    assert w.transfer.backend == "nixl" and w.num_threads == 2
    assert w.model.served_model_name == "tandem-arith"
    assert (w.parallel.tp_size, w.parallel.tp_rank, w.parallel.device) == (1, 0, "cpu")
    assert w.cache.max_total_tokens == 8192 and not w.cache.enable_prefix_cache
    w.validate()
    with pytest.raises(
        ClusterConfigError, match=r"--replica 2 is out of range: roles.decode.count is 2"
    ):
        worker_config(c, "decode", 2)
    with pytest.raises(
        ClusterConfigError,
        match=r"role 'both' is not in this config's roles \(it has: prefill, decode\)",
    ):
        worker_config(c, "both", 0)


def test_cuda_devices_handed_out_in_plan_order() -> None:
    c = config_from_dict({"roles": {
        "prefill": {"base_port": 51000, "parallel": {"device": "cuda", "tp_size": 2}},
        "decode": {"count": 2, "base_port": 52000, "parallel": {"device": "cuda"}},
    }})
    assert [
        worker_config(c, r, i).parallel.device
        for r, i in [("prefill", 0), ("decode", 0), ("decode", 1)]
    ] == ["cuda:0", "cuda:2", "cuda:3"]


def test_gateway_config_derivation() -> None:
    pinned = ["roles.prefill.base_port=50051", "roles.decode.base_port=50151"]
    c = load_config(
        CONFIGS / "tiny-2p2d.yaml",
        [
            "gateway.port=9000",
            "gateway.api_key=s3cret",
            "gateway.admin_key=adm",
            "launcher.cluster_id=c1",
            *pinned,
        ],
    )
    g = gateway_config(c)
    assert g.prefill == ("127.0.0.1:50051", "127.0.0.1:50061")
    assert g.decode == ("127.0.0.1:50151", "127.0.0.1:50161")
    assert g.workers == () and g.port == 9000 and g.api_key == "s3cret" and g.admin_key == "adm"
    assert g.model_path == c.model.path and g.served_model_name == "tandem-arith"
    assert g.cluster_id == "c1" and g.model_fingerprint.startswith("tandem-arith:")
    mono = gateway_config(load_config(CONFIGS / "tiny-mono.yaml", ["roles.both.base_port=50051"]))
    assert mono.workers == ("127.0.0.1:50051",) and mono.prefill == () and mono.decode == ()
    # Unpinned ports (the shipped configs): only the local launcher may start such a cluster.
    with pytest.raises(
        ClusterConfigError, match=r"roles.both.base_port is unset \(0\): only the local launcher"
    ):
        gateway_config(load_config(CONFIGS / "tiny-mono.yaml"))
    with pytest.raises(
        ClusterConfigError, match=r"gateway.admin_key must differ from gateway.api_key"
    ):
        load_config(CONFIGS / "tiny-mono.yaml", ["gateway.api_key=k", "gateway.admin_key=k"])
    wild = config_from_dict({"roles": {"both": {"host": "0.0.0.0", "base_port": 51000}}})
    # a wildcard bind is dialled on loopback
    assert gateway_config(wild).workers == ("127.0.0.1:51000",)


def test_gateway_settings_cover_every_gateway_field() -> None:
    # A GatewayConfig field that the YAML cannot set is a field nobody can tune: keep them in step.
    gateway_fields = {f.name for f in dataclasses.fields(GatewayConfig)} - set(
        GATEWAY_DERIVED_FIELDS
    )
    assert gateway_fields <= {f.name for f in dataclasses.fields(GatewaySettings)}


def test_cluster_config_is_frozen() -> None:
    c = ClusterConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model = c.model  # type: ignore[misc]


def test_a_run_file_takes_top_level_overrides_as_its_config_did(tmp_path: Path) -> None:
    """The run's cluster.yaml (what `tandem worker --join` is given) keeps a role's own cache
    and scheduler sections partial: a top-level `--kv-cache-dtype` or `--set cache.X` reaches
    that role as it did from configs/tiny-1p1d.yaml (the dump spelled every field of decode's
    section out, so the flag changed prefill alone and the pairing check refused it)."""
    run_file = tmp_path / "cluster.yaml"
    run_file.write_text(dump_config(load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml")))
    for path in (REPO_ROOT / "configs" / "tiny-1p1d.yaml", run_file):
        cluster = load_config(path, ["cache.kv_cache_dtype=fp8_e4m3", "scheduler.max_num_seqs=8"])
        decode = cluster.roles.decode
        assert decode is not None and decode.cache is not None
        assert (decode.scheduler or cluster.scheduler).max_num_seqs == 8, path
        assert decode.cache.kv_cache_dtype == "fp8_e4m3", path
        assert decode.cache.enable_prefix_cache is False, path  # the role's own field stays
    doc = yaml.safe_load(run_file.read_text())
    assert doc["roles"]["decode"]["cache"] == {"enable_prefix_cache": False}
