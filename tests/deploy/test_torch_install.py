"""`make install`'s device choice (deploy/torch_install.py) with a fake `nvidia-smi` on PATH.

The script runs as the Makefile runs it (a subprocess, the system python3, `--dry-run`), so
what is checked is the pip command line it would run; nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT

SCRIPT = REPO_ROOT / "deploy" / "torch_install.py"
SMI_H200 = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""


def fake_smi(tmp_path: Path, cuda: str | None, rc: int = 0) -> Path:
    """A directory holding an `nvidia-smi` that prints a driver for `cuda` (None: no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    text = SMI_H200.format(cuda=cuda) if cuda else "No devices were found\n"
    exe = bin_dir / "nvidia-smi"
    # A Python script: PATH holds nothing else, so not even `cat` is there for a shell one.
    exe.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({text!r})\n"
                   f"sys.exit({rc})\n")
    exe.chmod(0o755)
    return bin_dir


def run(args: list[str], path_dirs: list[Path] | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "TORCH_INDEX_URL")}
    # PATH holds only the fake: a machine's real nvidia-smi must not decide these tests
    full = {**base, "PATH": os.pathsep.join(str(d) for d in path_dirs or []), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=full, timeout=60, check=False)


def test_no_gpu_keeps_the_cpu_command_exactly(tmp_path: Path) -> None:
    out = run(["--device", "auto", "--dry-run", "--pip", "PIP"], env={"PIP_FIND_LINKS": "/w"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PIP install -q torch==2.13.0"
    assert run(["--device", "auto", "--which"]).stdout.strip() == "cpu"
    assert run(["--device", "auto", "--extras"]).stdout.strip() == "test,transfer,nixl,ray"
    # nvidia-smi present but listing no GPU (exit 6 as the real one): still the CPU build
    no_gpu = fake_smi(tmp_path, None, rc=6)
    assert run(["--device", "auto", "--which"], [no_gpu]).stdout.strip() == "cpu"


def test_a_gpu_picks_the_cuda_build_and_its_triton(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path, "13.0")
    out = run(["--device", "auto", "--dry-run", "--pip", "PIP"], [smi],
              env={"PIP_FIND_LINKS": "/opt/wheels"})
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split("#")[0].split()
    assert cmd[:2] == ["PIP", "install"] and "torch==2.13.0" in cmd and "triton==3.7.1" in cmd
    # the local CPU wheel directory is left out, or its CPU build would satisfy the pin
    assert "without PIP_FIND_LINKS" in out.stdout and "nvidia-smi found a GPU" in out.stderr
    assert run(["--device", "auto", "--extras"], [smi]).stdout.strip() == \
        "test,transfer-cuda,nixl,ray"
    with_index = run(["--device", "cuda", "--dry-run"], [smi],
                     env={"TORCH_INDEX_URL": "file:///idx"})
    assert "--index-url file:///idx" in with_index.stdout


def test_pins_come_from_pyproject() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import torch_install
    finally:
        sys.path.pop(0)
    pins = torch_install.read_pins()
    text = (REPO_ROOT / "pyproject.toml").read_text()
    for key in ("torch_cpu", "torch_cuda", "triton"):
        assert f'{key} = "{pins[key]}"' in text
    smi = SMI_H200.format(cuda="13.0")
    cmds = torch_install.commands("cuda", pins, ["pip"], {"PIP_FIND_LINKS": "/w"})
    assert cmds == [(["pip", "install", "-q", "--no-cache-dir", pins["torch_cuda"],
                      pins["triton"]], {})]
    assert torch_install.detect_device("auto", smi) == "cuda"
    assert torch_install.detect_device("cpu", smi) == "cpu"


@pytest.mark.parametrize(("args", "cuda", "message"), [
    (["--device", "cuda"], "12.4", "the NVIDIA driver here runs CUDA 12.4 but the pinned torch "
                                   "CUDA build needs 13.0"),
    (["--device", "cuda"], None, "DEVICE=cuda but `nvidia-smi` shows no driver"),
    (["--device", "tpu"], None, "DEVICE='tpu': use auto, cpu or cuda"),
])
def test_refusals_are_one_line(tmp_path: Path, args: list[str], cuda: str | None,
                               message: str) -> None:
    out = run([*args, "--dry-run"], [fake_smi(tmp_path, cuda, rc=0 if cuda else 6)])
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr


def test_a_venv_made_for_another_device_is_named(tmp_path: Path) -> None:
    stamp = tmp_path / ".installed"
    stamp.write_text("cpu\n")
    out = run(["--device", "cuda", "--check-stamp", str(stamp)], [fake_smi(tmp_path, "13.0")])
    assert out.returncode == 0 and "was installed for cpu, not cuda" in out.stderr
    assert run(["--device", "cpu", "--check-stamp", str(stamp)]).stderr == ""


def test_an_image_build_gets_its_torch_index_and_skips_the_driver_check(tmp_path: Path) -> None:
    # The CPU image: PyPI's torch is the CUDA build, so the CPU one comes from TORCH_INDEX_URL.
    out = run(["--device", "cpu", "--dry-run", "--pip", "PIP"],
              env={"TORCH_INDEX_URL": "https://idx/cpu"})
    assert out.stdout.strip() == "PIP install -q --index-url https://idx/cpu torch==2.13.0"
    # The CUDA image is built where there is no GPU: the driver is the node's, checked there.
    no_gpu = fake_smi(tmp_path, None, rc=6)
    assert run(["--device", "cuda", "--which"], [no_gpu]).returncode == 2
    built = run(["--device", "cuda", "--dry-run", "--pip", "PIP"], [no_gpu],
                env={"TANDEM_NO_DRIVER_CHECK": "1"})
    assert built.returncode == 0 and "torch==2.13.0 triton==3.7.1" in built.stdout, built.stderr
    # It never turns a machine without a GPU into a CUDA one.
    auto = run(["--device", "auto", "--which"], [no_gpu], env={"TANDEM_NO_DRIVER_CHECK": "1"})
    assert auto.stdout.strip() == "cpu"
