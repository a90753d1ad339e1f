"""The image recipe (deploy/Dockerfile, `make image`) agrees with the repository it builds.

No image is built here (that takes minutes and a container builder; docs/deploy.md says how it
was checked): the Dockerfile is parsed and every thing it relies on is checked against the real
thing: the make target and variables it runs, the files it copies and links, the command line
of its entrypoint against `tandem`'s own parser, the ports the manifests expect, the image
names the manifests use against the tags `make image` gives, and the build context's ignore
file against .gitignore.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import build_parser, serve_config
from orchestrator.config import REPO_ROOT, config_from_dict

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
K8S = REPO_ROOT / "deploy" / "k8s"
APP = "/opt/tandem"  # the Dockerfile's WORKDIR: the repository inside the image


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    joined = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        word, _, rest = joined.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        joined = ""
    return out


def of(kind: str) -> list[str]:
    return [args for k, args in instructions(DOCKERFILE.read_text()) if k == kind]


def arg_defaults() -> dict[str, str]:
    out = {}
    for a in of("ARG"):
        name, _, default = a.partition("=")
        out[name] = default.strip('"')
    return out


def make_n(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_it_installs_with_make_install_and_the_variables_make_reads() -> None:
    (run,) = [r for r in of("RUN") if "make install" in r]
    assert "DEVICE=\"$DEVICE\"" in run and "TORCH_INDEX_URL=\"$TORCH_INDEX_URL\"" in run
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^install: ", makefile, flags=re.M)
    assert "DEVICE ?=" in makefile  # make reads DEVICE; torch_install.py reads the rest
    script = (REPO_ROOT / "deploy" / "torch_install.py").read_text()
    assert 'env["TORCH_INDEX_URL"]' in script and '"TANDEM_NO_DRIVER_CHECK"' in script
    assert "TANDEM_NO_DRIVER_CHECK=1" in run
    args = arg_defaults()
    # The CPU image by default, its torch from PyTorch's CPU index (PyPI's is the CUDA build).
    assert args["DEVICE"] == "cpu" and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert of("WORKDIR") == [APP] and of("COPY") == [". ."]
    assert of("ENV")[-1] == f"PATH={APP}/.venv/bin:$PATH"  # `tandem` as the manifests call it


def test_the_embedded_model_is_at_the_path_the_cpu_overlay_serves() -> None:
    (run,) = [r for r in of("RUN") if "ln -s" in r]
    target, link = shlex.split(run.split("ln -s", 1)[1])[:2]
    assert target.startswith(APP + "/")
    assert (REPO_ROOT / target.removeprefix(APP + "/") / "config.json").is_file()
    cluster = config_from_dict(yaml.safe_load((K8S / "base" / "cluster.yaml").read_text()))
    assert cluster.model.path == link == "/models/tandem-arith"


def test_entrypoint_and_cmd_are_a_real_tandem_serve_reachable_from_outside() -> None:
    (entry,), (cmd,) = of("ENTRYPOINT"), of("CMD")
    argv = [*json.loads(entry), *json.loads(cmd)]
    assert argv[0] == "tandem"
    args = build_parser().parse_args(argv[1:])
    assert (REPO_ROOT / args.config).is_file()  # relative to WORKDIR, the repository
    cluster = serve_config(args)
    assert (cluster.gateway.host, cluster.gateway.port) == ("0.0.0.0", 8000)


def test_exposed_ports_are_the_manifests_ports() -> None:
    exposed = {int(p) for e in of("EXPOSE") for p in e.split()}
    cluster = config_from_dict(yaml.safe_load((K8S / "base" / "cluster.yaml").read_text()))
    want = {cluster.gateway.port} | {rc.base_port for _, rc in cluster.roles.present()}
    assert exposed == want


def manifest_images() -> set[str]:
    """Every image the manifests name: base `image:` lines as kustomize's images: retag them."""
    images = set()
    for f in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            for m in re.finditer(r"'image': '([^']+)'", str(doc)):
                images.add(m.group(1))
            if isinstance(doc, dict) and doc.get("kind") == "Kustomization":
                for im in doc.get("images", []):
                    images.add(f"{im.get('newName', im['name'])}:{im['newTag']}")
    return images


def tags(*make_args: str) -> set[str]:
    return set(re.findall(r"-t (\S+)", make_n("image", "CONTAINER=builder", *make_args)))


def test_make_image_builds_every_image_the_manifests_use() -> None:
    cpu, cuda = tags(), tags("DEVICE=cuda")
    assert cpu == {"tandem:cpu", "tandem:latest"} and cuda == {"tandem:cuda"}
    assert manifest_images() == cpu | cuda
    line = make_n("image", "CONTAINER=builder", "DEVICE=cuda").splitlines()
    build = " ".join(ln.rstrip("\\") for ln in line if not ln.startswith("test "))
    assert "builder build -f deploy/Dockerfile --build-arg DEVICE=cuda" in build
    assert "--build-arg TORCH_INDEX_URL= " in build  # cuda: PyPI's build, not the CPU index


def ignore_lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """dockerignore's matching, for the pattern forms used: rooted, or `**/` at any depth."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(p, pat[3:]) for p in parts):
                return True
        elif any(fnmatch.fnmatch(p, pat) for p in prefixes):
            return True
    return False


def test_the_build_context_leaves_out_what_git_ignores_and_keeps_every_tracked_file() -> None:
    docker = ignore_lines(REPO_ROOT / ".dockerignore")
    for line in ignore_lines(REPO_ROOT / ".gitignore"):
        name = line.strip("/")
        rooted = line.startswith("/")
        assert (name if rooted else f"**/{name}") in docker or name in docker, line
    assert ".git" in docker
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout.splitlines()
    assert tracked and not [f for f in tracked if ignored(f, docker)]
    assert ignored(".venv/bin/python", docker) and ignored("worker/__pycache__/x.pyc", docker)


BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}  # in every Debian 12 image (apt needs them)


def test_system_libraries_of_the_transfer_backend_are_installed_by_make_install() -> None:
    """The image found it: Mooncake's engine links libcurl (and libnuma) from the system; a
    machine that lacked them failed only when a worker started."""
    if shutil.which("readelf") is None or shutil.which("dpkg") is None:
        pytest.skip("needs readelf and dpkg (Debian)")
    engine = next(Path(p) for p in __import__("mooncake").__path__).glob("engine*.so")
    so = next(engine, None)
    if so is None:
        pytest.skip("mooncake's engine is not installed")
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    wheel_libs = {p.name for p in so.parent.parent.rglob("*.so*")}
    script = (REPO_ROOT / "deploy" / "install-system-deps.sh").read_text()
    missing = []
    for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn):
        if lib in wheel_libs or lib.startswith("ld-linux"):
            continue
        owner = subprocess.run(["dpkg", "-S", f"*/{lib}"], capture_output=True, text=True,
                               timeout=60, check=False).stdout
        package = owner.split(":")[0] if owner else f"(no package has {lib})"
        if package not in BASE_PACKAGES and package not in script:
            missing.append(f"{lib}: {package}")
    assert missing == []
