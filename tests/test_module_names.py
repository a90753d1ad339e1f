"""No script directory holds a module named like the standard library's: `python3 bench/X.py`
puts bench/ first on sys.path, so a bench/profile.py was imported by cProfile in place of the
stdlib `profile` and failed bench/gpu.py's mixed steps on the H200."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("bench", "models", "deploy", "bench/device")


def test_no_script_shadows_a_stdlib_module() -> None:
    clashes = sorted(
        str(path.relative_to(REPO))
        for d in SCRIPT_DIRS
        for path in (REPO / d).glob("*.py")
        if path.stem in sys.stdlib_module_names
    )
    assert not clashes, f"rename these, they shadow the standard library: {clashes}"
