"""The import graph: the package rules of DESIGN.md, and no import circle inside a package.

An AST scan of every module, imports inside functions included (a lazy back-import is still a
circle: it only hides it from the interpreter until the call). The checker is run on planted
graphs first, so a scan that finds nothing means something.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("protocol", "transfer", "worker", "gateway", "orchestrator")
# Which of our packages each package may import (DESIGN.md, "who may import whom").
ALLOWED = {
    "protocol": set(),
    "transfer": {"protocol"},
    "worker": {"transfer", "protocol"},
    "gateway": {"protocol"},
}
ACYCLIC = ("protocol", "transfer", "worker", "gateway", "orchestrator")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool,
               modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module of ours that `source` imports, anywhere in the file (TYPE_CHECKING blocks
    excluded: they never run). `from pkg import name` names the module pkg.name when it is one
    of `modules` (importing a submodule), else pkg."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            out.update(subs or {base})
            if len(subs) < len(node.names):
                out.add(base)
    return {m for m in out if m.split(".")[0] in OURS}


def graph(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (names that are not modules are dropped)."""
    files = [p for pkg in OURS for p in (root / pkg).rglob("*.py") if ".venv" not in p.parts]
    names = {module_name(p): p for p in files}
    known = frozenset(names)
    out: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = imports_of(path.read_text(), name, path.name == "__init__.py", known)
        # A module's own parent packages run before it whatever it imports: no edge to them.
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        out[name] = {d for d in deps if d in names and d != name and d not in parents}
    return out


def find_cycle(edges: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One import circle among `nodes` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if m not in nodes:
                continue
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := visit(m)) is not None:
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_checker_finds_planted_cycles_and_lazy_imports() -> None:
    src = "def f():\n    from worker.engine import Engine\n"
    assert imports_of(src, "worker.tp_runner", False) == {"worker.engine"}
    sub = "from worker.model import fused, load_model\n"
    mods = frozenset({"worker.model", "worker.model.fused"})
    assert imports_of(sub, "worker.x", False, mods) == {"worker.model", "worker.model.fused"}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import worker.engine\n"
    assert imports_of(typing_only, "worker.x", False) == set()
    relative = "from . import runner\nfrom .model import base\n"
    mods = frozenset({"worker.runner", "worker.model.base"})
    assert imports_of(relative, "worker.engine", False, mods) == set(mods)
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges, set(edges)) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}, {"a", "b"}) is None


def test_packages_import_only_what_the_design_allows() -> None:
    bad = []
    for module, deps in graph().items():
        pkg = module.split(".")[0]
        if pkg not in ALLOWED:
            continue
        for dep in deps:
            other = dep.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{module} imports {dep}")
    assert not bad, bad


def test_no_import_circle_inside_a_package() -> None:
    edges = graph()
    for pkg in ACYCLIC:
        nodes = {m for m in edges if m.split(".")[0] == pkg}
        cycle = find_cycle(edges, nodes)
        assert cycle is None, f"import circle in {pkg}/: {' -> '.join(cycle or [])}"
