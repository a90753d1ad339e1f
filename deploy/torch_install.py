"""Which torch `make install` puts in the venv: the CPU build, or the CUDA build and its triton.

    python3 deploy/torch_install.py --device auto --pip ".venv/bin/python -m pip"   # install
    python3 deploy/torch_install.py --device auto --dry-run                         # print only
    python3 deploy/torch_install.py --device auto --extras                          # pip extras

`--device auto` (the Makefile's default, `DEVICE=cuda|cpu` overrides) picks CUDA when
`nvidia-smi` is on PATH and lists a GPU. The pins are in pyproject.toml,
`[tool.tandem.install]`:
- cpu: `torch_cpu` exactly as before (the CPU wheel; on the dev box it comes from the local
  wheel directory pip is configured with).
- cuda: `torch_cuda` and `triton` (the pair PyPI's Linux torch wheel is built with), from the
  package index only (a configured local directory of CPU wheels would win otherwise), after
  checking that the driver runs CUDA `cuda_min` or newer (`nvidia-smi` prints the version
  its driver supports). `TORCH_INDEX_URL` points pip at another index of torch builds (e.g. one
  for an older CUDA); the pins stay. `TANDEM_NO_DRIVER_CHECK=1` skips the driver check of an
  explicit `--device cuda` (an image build, deploy/Dockerfile: the driver is the node's).
- cpu with `TORCH_INDEX_URL`: the pin from that index (the CPU image: PyPI's Linux torch wheel
  is the CUDA build, the CPU one is on PyTorch's CPU index).
Only the standard library: this runs before the venv has anything in it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DRIVER_CUDA = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


class InstallError(RuntimeError):
    """Cannot install for the asked device; the message says why and what to do."""


def read_pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """`key = "value"` lines of the [tool.tandem.install] table (no TOML library on 3.10)."""
    pins: dict[str, str] = {}
    inside = False
    for line in pyproject.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[tool.tandem.install]"
            continue
        m = re.match(r'^([A-Za-z_]+)\s*=\s*"([^"]*)"', stripped)
        if inside and m:
            pins[m.group(1)] = m.group(2)
    for key in ("torch_cpu", "torch_cuda", "triton", "cuda_min", "extras_cpu", "extras_cuda"):
        if key not in pins:
            raise InstallError(f"pyproject.toml [tool.tandem.install]: {key} is missing")
    return pins


def nvidia_smi() -> str:
    """nvidia-smi's output, '' when it is absent or fails (no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def detect_device(asked: str, smi: str) -> str:
    """cpu | cuda: what `asked` (auto | cpu | cuda) means on this machine."""
    if asked not in ("auto", "cpu", "cuda"):
        raise InstallError(f"DEVICE={asked!r}: use auto, cpu or cuda")
    if asked != "auto":
        return asked
    return "cuda" if _DRIVER_CUDA.search(smi) else "cpu"


def check_driver(smi: str, cuda_min: str) -> None:
    m = _DRIVER_CUDA.search(smi)
    if m is None:
        raise InstallError("DEVICE=cuda but `nvidia-smi` shows no driver (is it on PATH, and does "
                           "it list a GPU?); install the NVIDIA driver or use DEVICE=cpu")
    have = (int(m.group(1)), int(m.group(2)))
    need = tuple(int(x) for x in cuda_min.split("."))
    if have < need:
        raise InstallError(f"the NVIDIA driver here runs CUDA {have[0]}.{have[1]} but the pinned "
                           f"torch CUDA build needs {cuda_min}; update the driver, or set "
                           "TORCH_INDEX_URL to an index of torch builds for your CUDA")


def commands(device: str, pins: dict[str, str], pip: list[str],
             env: dict[str, str]) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of each pip call that installs torch for `device`."""
    index = ["--index-url", env["TORCH_INDEX_URL"]] if env.get("TORCH_INDEX_URL") else []
    if device == "cpu":  # exactly the command of before (no index given): the CPU wheel
        return [([*pip, "install", "-q", *index, pins["torch_cpu"]], env)]
    # Without the configured local wheel directory: its CPU wheel would satisfy the pin.
    clean = {k: v for k, v in env.items() if k != "PIP_FIND_LINKS"}
    argv = [*pip, "install", "-q", "--no-cache-dir", *index, pins["torch_cuda"], pins["triton"]]
    return [(argv, clean)]


def check_stamp(stamp: Path, device: str) -> int:
    """0; a warning when the venv was made for another device (make does not redo it)."""
    have = stamp.read_text().strip() if stamp.is_file() else ""
    if have in ("cpu", "cuda") and have != device:
        print(f"warning: {stamp.parent} was installed for {have}, not {device}; run `make clean "
              f"install DEVICE={device}` to switch", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=os.environ.get("DEVICE", "auto"))
    ap.add_argument("--pip", default=f"{sys.executable} -m pip", help="the pip to run")
    ap.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    ap.add_argument("--extras", action="store_true", help="print the device's pip extras")
    ap.add_argument("--which", action="store_true", help="print cpu or cuda")
    ap.add_argument("--check-stamp", metavar="FILE",
                    help="warn when the venv behind FILE was installed for another device")
    args = ap.parse_args(argv)
    try:
        pins = read_pins()
        smi = nvidia_smi() if args.device in ("auto", "cuda") else ""
        device = detect_device(args.device, smi)
        if device == "cuda" and os.environ.get("TANDEM_NO_DRIVER_CHECK") != "1":
            check_driver(smi, pins["cuda_min"])
        if args.extras or args.which:
            print(pins[f"extras_{device}"] if args.extras else device)
            return 0
        if args.check_stamp:
            return check_stamp(Path(args.check_stamp), device)
        cmds = commands(device, pins, shlex.split(args.pip), dict(os.environ))
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"torch for {device}" + (" (nvidia-smi found a GPU)" if device == "cuda"
                                   and args.device == "auto" else ""), file=sys.stderr)
    for cmd, env in cmds:
        dropped = "PIP_FIND_LINKS" in os.environ and "PIP_FIND_LINKS" not in env
        print(shlex.join(cmd) + ("   # without PIP_FIND_LINKS" if dropped else ""))
        if not args.dry_run:
            rc = subprocess.run(cmd, env=env, check=False).returncode
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
