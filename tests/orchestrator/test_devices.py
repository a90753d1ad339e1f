"""device auto, the CUDA probe (no torch import), plan's refusal of cuda where CUDA is absent,
and the GPU configs in configs/ through `tandem plan`."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import devices
from orchestrator.cli import main
from orchestrator.config import REPO_ROOT, load_config
from orchestrator.devices import CudaStatus, cuda_status, resolve_device, visible_gpus
from orchestrator.rank_map import plan_processes
from orchestrator.worker_config import worker_config

SHAPE_8B = REPO_ROOT / "bench" / "models" / "qwen3-8b-shape"
SHAPE_MOE = REPO_ROOT / "bench" / "models" / "qwen3-30b-a3b-shape"


def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    monkeypatch.setattr(devices, "torch_cuda_version", lambda: "")


def test_visible_gpus_reads_dev_and_cuda_visible_devices(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, tmp_path) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}, tmp_path) == 1
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, tmp_path) == 0


def test_torch_build_is_read_without_importing_torch() -> None:
    import importlib.util
    import sys

    had = "torch" in sys.modules
    version = devices.torch_cuda_version()
    assert ("torch" in sys.modules) == had  # the probe did not import it
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    assert (version == "") == ("cuda: Optional[str] = None" in text or "cuda = None" in text)


def test_auto_follows_the_machine() -> None:
    gpu = CudaStatus(gpus=2, torch_cuda="13.0")
    assert resolve_device("auto", gpu) == "cuda"
    assert resolve_device("auto", CudaStatus(gpus=2, torch_cuda="")) == "cpu"
    assert resolve_device("auto", CudaStatus(gpus=0, torch_cuda="13.0")) == "cpu"
    assert resolve_device("cuda:3", CudaStatus(gpus=0, torch_cuda="")) == "cuda:3"
    c = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml")
    assert c.role("prefill").parallel.device == "auto"  # the default
    assert [r.device for r in plan_processes(c, gpu)][:2] == ["cuda:0", "cuda:1"]
    assert [r.device for r in plan_processes(c, CudaStatus(0, ""))][:2] == ["cpu", "cpu"]
    expected = "cuda:0" if cuda_status().available else "cpu"
    assert worker_config(c, "prefill").parallel.device == expected


def test_plan_refuses_cuda_without_cuda_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    no_cuda(monkeypatch)
    rc = main(["plan", "--config", "configs/tiny-1p1d.yaml",
               "--set", "roles.decode.parallel.device=cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert ("roles.decode.parallel.device=cuda: CUDA is not usable here (this machine has no "
            "NVIDIA GPU and torch here is a CPU build)") in err
    # serve refuses the same way, before it starts anything
    assert main(["serve", "--set", "roles.decode.parallel.device=cuda:0",
                 "--set", "launcher.log_dir=/nonexistent/logs"]) == 2
    assert "roles.decode.parallel.device=cuda:0: CUDA is not usable here" in \
        capsys.readouterr().err
    # a GPU machine that cannot hold the layout is named too
    assert main(["plan", "--config", "configs/gpu-moe-ep.yaml", "--gpus", "4"]) == 2
    assert "use GPUs cuda:0..cuda:7 (8 rank processes) but this machine has 4" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("config", "shape", "devices_expected"), [
    ("gpu-8b-1p1d.yaml", SHAPE_8B, ["cuda:0", "cuda:1"]),
    ("gpu-8b-1p1d-2node.yaml", SHAPE_8B, ["cuda:0", "cuda:0"]),
    ("gpu-moe-ep.yaml", SHAPE_MOE, [f"cuda:{i}" for i in range(8)]),
])
def test_gpu_configs_plan(config: str, shape: Path, devices_expected: list[str],
                          monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    no_cuda(monkeypatch)  # what this check says must not depend on the machine running it
    args = ["plan", "--config", f"configs/{config}", "--set", f"model.path={shape}"]
    spread = "2node" in config  # Slurm: the nodes are elsewhere, nothing probed here
    assert main(args if spread else [*args, "--gpus", "8"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("prefill-", "decode-"))]
    assert [r[5] for r in rows] == devices_expected
    assert "KV budget: unknown" not in out and "bfloat16" in out
    if config == "gpu-moe-ep.yaml":  # EP over each worker's ranks: 128 experts, 32 per rank
        assert [r[9] for r in rows] == [f"{i}/4" for i in range(4)] * 2
        assert [r[8] for r in rows[4:]] == [f"{i}/4" for i in range(4)]  # decode: attention DP
    if not spread:
        assert main(args) == 2  # here, without --gpus: no CUDA on this (pretended) machine
        assert "CUDA is not usable here" in capsys.readouterr().err
