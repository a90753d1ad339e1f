"""Reading a cluster YAML file: PyYAML's parse, plus the one mistake it lets through.

PyYAML keeps the last of two equal keys in a mapping without a word, so a second `port:` in
`gateway:` silently wins over the first. Here the file is composed first (nodes carry their
line numbers) and a duplicate key anywhere is refused in one line naming the key, the section
it is in and both lines; then it is loaded as usual. Errors are ClusterConfigError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.config_checks import ClusterConfigError

MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor`: may appear beside the keys it supplies


def _check_unique_keys(node: yaml.Node, where: str, path: Path, seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already checked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}  # (tag, text) of a key -> its line
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != MERGE_TAG:
                line = key.start_mark.line + 1
                if (key.tag, key.value) in first:
                    place = f"in '{where}'" if where else "at the top level"
                    raise ClusterConfigError(
                        f"{path}: line {line}: duplicate key '{key.value}' {place} "
                        f"(the first is at line {first[key.tag, key.value]}): keep one")
                first[key.tag, key.value] = line
                _check_unique_keys(value, f"{where}.{key.value}" if where else key.value,
                                   path, seen)
            else:
                _check_unique_keys(value, where, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{where}[{i}]", path, seen)


def read_yaml(path: Path) -> Any:
    """The file's data; ClusterConfigError in one line for invalid YAML or a duplicate key."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ClusterConfigError(f"{path}: is not UTF-8 text (byte {exc.start}: "
                                 f"{exc.object[exc.start:exc.start + 1]!r}); pass a YAML "
                                 "cluster config (e.g. configs/tiny-1p1d.yaml)") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _check_unique_keys(root, "", path, set())
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:  # one line: where, and what (PyYAML's text spans several)
        mark = getattr(exc, "problem_mark", None)
        at = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ClusterConfigError(f"{at}: not valid YAML: {what}") from None
