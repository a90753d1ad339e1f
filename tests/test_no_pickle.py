"""No code-executing deserialization in our packages: every network path is protobuf or JSON.

An AST scan (not a grep: comments and strings do not count, aliases do) over every module of
protocol/, transfer/, worker/, gateway/ and orchestrator/ for pickle and its relatives, unsafe
YAML loading, torch.load without weights_only=True, numpy allow_pickle=True, eval/exec, and
torch.distributed's object collectives (they pickle what a peer sends). The scanner is tested
on planted sources first, so a scan that finds nothing means something.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "transfer", "worker", "gateway", "orchestrator")

UNSAFE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "jsonpickle",
    "joblib",
}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "send_object_list",
    "recv_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
}
UNSAFE_YAML = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all", "full_load_all"}


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, filename: str = "<src>") -> list[str]:
    """Every unsafe-deserialization site in `source`, as 'file:line: what'."""
    out: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [
                f"{where}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES
        ):
            out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and any(
            a.name in OBJECT_COLLECTIVES for a in node.names
        ):
            out.append(f"{where}: imports a pickling collective from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
                out.append(f"{where}: {f.id}()")
            elif isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else ""
                if f.attr in OBJECT_COLLECTIVES:
                    out.append(f"{where}: {f.attr} (pickles peer data)")
                elif base == "yaml" and f.attr in UNSAFE_YAML and not _safe_loader(node):
                    out.append(f"{where}: yaml.{f.attr} without SafeLoader")
                elif (
                    base == "torch" and f.attr == "load" and not _is_true(_kw(node, "weights_only"))
                ):
                    out.append(f"{where}: torch.load without weights_only=True")
                elif (
                    base in ("np", "numpy")
                    and f.attr == "load"
                    and _is_true(_kw(node, "allow_pickle"))
                ):
                    out.append(f"{where}: numpy.load(allow_pickle=True)")
    return out


def _safe_loader(call: ast.Call) -> bool:
    loader = _kw(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
    return isinstance(loader, ast.Attribute) and loader.attr in ("SafeLoader", "CSafeLoader")


@pytest.mark.parametrize(
    "planted",
    [
        "import pickle\npickle.loads(b'')",
        "import cloudpickle as cp",
        "from pickle import loads",
        "import yaml\nyaml.load(open('x'))",
        "import yaml\nyaml.load(s, Loader=yaml.Loader)",
        "import torch\ntorch.load('x')",
        "import numpy as np\nnp.load('x', allow_pickle=True)",
        "eval(data)",
        "exec(code)",
        "import torch.distributed as dist\ndist.broadcast_object_list(objs)",
        "from torch.distributed import recv_object_list",
        "import marshal",
    ],
)
def test_scanner_catches_planted_sources(planted: str) -> None:
    assert findings(planted), f"the scanner missed: {planted!r}"


@pytest.mark.parametrize(
    "safe",
    [
        "import yaml\nyaml.safe_load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import torch\ntorch.load('x', weights_only=True)",
        "model.eval()",
        "x = 'import pickle'  # pickle in a string or comment is no import",
    ],
)
def test_scanner_passes_safe_sources(safe: str) -> None:
    assert findings(safe) == []


def test_no_unsafe_deserialization_in_our_packages() -> None:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    assert len(files) > 40, f"scanned only {len(files)} files: wrong root?"
    hits = [h for p in files for h in findings(p.read_text(), str(p.relative_to(REPO)))]
    assert not hits, (
        "code-executing deserialization (protobuf/JSON only on network paths):\n" + "\n".join(hits)
    )
