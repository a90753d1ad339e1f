"""Every name a bench script imports from the project exists: benches run on the GPU machine or
by hand, not in the suite, so a name moved in the tree (tests.gateway.gw_doubles'
build_tokenizer went to gw_tokenizers) broke `python -m bench.gateway` unseen. The scripts are
read with ast, not run; the project modules they name are imported."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = ("bench", "gateway", "orchestrator", "protocol", "tests", "transfer", "worker")


def _project_imports(path: Path) -> list[tuple[str, str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.module, alias.name, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and node.module.split(".")[0] in PROJECT
            for alias in node.names]


def test_bench_scripts_import_names_that_exist() -> None:
    missing = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for module, name, line in _project_imports(path):
            mod = importlib.import_module(module)
            if not hasattr(mod, name):
                try:  # a submodule imported by name
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError:
                    missing.append(f"{path.relative_to(REPO)}:{line}: {module}.{name}")
    assert not missing, "bench scripts import names that do not exist:\n" + "\n".join(missing)
