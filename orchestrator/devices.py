"""Is there CUDA here? Answered without importing torch (plan and the launcher stay light).

CUDA is usable when the installed torch is a CUDA build (its `torch/version.py` names a CUDA
version; the CPU wheel says `cuda = None`) and the machine shows NVIDIA devices
(`/dev/nvidia0`, ...; `CUDA_VISIBLE_DEVICES` narrows them as it narrows torch's view).
`parallel.device: auto` becomes `cuda` where both hold and `cpu` elsewhere, on the machine that
computes the worker configs (the local launcher, or each Slurm node's).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_CUDA_LINE = re.compile(r"^cuda\s*(?::[^=]*)?=\s*['\"]?([^'\"\s]+)['\"]?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class CudaStatus:
    """What this machine offers: GPUs torch could use, and why not when there are none."""

    gpus: int  # NVIDIA devices visible (0: none)
    torch_cuda: str  # the CUDA version torch was built for; "" = a CPU build (or no torch)
    assumed: bool = False  # given by `tandem plan --gpus N`, not probed

    @property
    def available(self) -> bool:
        return self.gpus > 0 and (bool(self.torch_cuda) or self.assumed)

    def why_not(self) -> str:
        """One clause saying why CUDA is not usable here ('' when it is)."""
        if self.available:
            return ""
        if not self.torch_cuda and self.gpus:
            return (f"torch here is a CPU build although {self.gpus} NVIDIA GPUs are visible; "
                    "reinstall with `make install DEVICE=cuda`")
        if not self.torch_cuda:
            return "this machine has no NVIDIA GPU and torch here is a CPU build"
        return f"torch here is built for CUDA {self.torch_cuda} but no NVIDIA GPU is visible"


def torch_cuda_version() -> str:
    """The CUDA version the installed torch was built for, read from torch/version.py."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return ""
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        match = _CUDA_LINE.search(version.read_text())
    except OSError:
        return ""
    value = match.group(1) if match else ""
    return "" if value == "None" else value


def visible_gpus(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """NVIDIA devices in /dev, narrowed by CUDA_VISIBLE_DEVICES when it is set."""
    env = os.environ if env is None else env
    found = sum(1 for p in dev.glob("nvidia*") if p.name[6:].isdigit())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    named = [v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]
    return min(found, len(named))


def cuda_status(gpus: int | None = None) -> CudaStatus:
    """This machine's status, or (`gpus` given) a machine assumed to have that many GPUs."""
    if gpus is not None:
        return CudaStatus(gpus=gpus, torch_cuda=torch_cuda_version(), assumed=True)
    return CudaStatus(gpus=visible_gpus(), torch_cuda=torch_cuda_version())


def resolve_device(device: str, cuda: CudaStatus) -> str:
    """`auto` -> `cuda` where CUDA is usable, else `cpu`; other values unchanged."""
    if device != "auto":
        return device
    return "cuda" if cuda.available else "cpu"
