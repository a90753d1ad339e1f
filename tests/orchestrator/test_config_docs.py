"""docs/config.md lists every key of the config tree, and only keys that exist.

The README promises that the doc "lists every key": a field added to a config dataclass without
a line in the doc fails here, and so does a documented key that no dataclass has any more.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from orchestrator.config import REPO_ROOT, ClusterConfig, RoleConfig

DOC = REPO_ROOT / "docs" / "config.md"
# RoleConfig's own `cache` / `scheduler` are partial copies of the cluster's sections: the doc
# names them as one key each (their fields are the sections' fields).
NOT_RECURSED = {(RoleConfig, "cache"), (RoleConfig, "scheduler")}


def _dataclass_of(tp: Any) -> type | None:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def keys_of(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf field under `cls` (a nested section's fields, not the section)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        sub = _dataclass_of(hints[f.name])
        if sub is None or (cls, f.name) in NOT_RECURSED:
            out.append(prefix + f.name)
        else:
            out += keys_of(sub, f"{prefix}{f.name}.")
    return out


def section_keys() -> dict[str, list[str]]:
    """Top-level section -> its keys relative to the section (roles: one RoleConfig's keys)."""
    out = {}
    for f in dataclasses.fields(ClusterConfig):
        cls = _dataclass_of(typing.get_type_hints(ClusterConfig)[f.name])
        assert cls is not None, f.name
        out[f.name] = keys_of(RoleConfig if f.name == "roles" else cls)
    return out


def doc_sections(text: str, sections: set[str]) -> dict[str, str]:
    """Section name -> the text under the `### ...` headings that name it in backticks."""
    out: dict[str, str] = {}
    parts = re.split(r"^### ", text, flags=re.M)[1:]
    for part in parts:
        heading, _, body = part.partition("\n")
        for name in re.findall(r"`([a-z_]+)`", heading):
            if name in sections:
                out[name] = out.get(name, "") + part
    return out


def spans(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


def undocumented(text: str) -> list[str]:
    """Dotted keys (section.key) that no backticked span in their section names."""
    keys = section_keys()
    found = doc_sections(text, set(keys))
    missing = [f"{s} (no `### ` heading names it)" for s in keys if s not in found]
    for section, body in found.items():
        named = spans(body)
        for key in keys[section]:
            # `cache.page_size` or `page_size` (a table of one section), `parallel.nnodes` or
            # `nnodes` (a row listing several), `roles.R.x` never: the section is implied.
            candidates = {key, f"{section}.{key}", key.rsplit(".", 1)[-1]}
            if not candidates & named:
                missing.append(f"{section}.{key}")
    return missing


def unknown_in_tables(text: str) -> list[str]:
    """Keys in the first column of a section's table that are no field of that section."""
    keys = section_keys()
    bad = []
    for section, body in doc_sections(text, set(keys)).items():
        valid = set(keys[section]) | {f"{section}.{k}" for k in keys[section]}
        valid |= {k.rsplit(".", 1)[-1] for k in keys[section]}
        if section in ("cache", "scheduler"):  # one table for both sections
            valid |= {f"{s}.{k}" for s in ("cache", "scheduler") for k in keys[s]}
        for row in re.findall(r"^\| *(`[^|]+)\|", body, flags=re.M):
            bad += [f"{section}: {k}" for k in spans(row) if k not in valid]
    return bad


def test_every_config_key_is_documented() -> None:
    assert undocumented(DOC.read_text()) == []


def test_every_key_in_the_doc_tables_exists() -> None:
    assert unknown_in_tables(DOC.read_text()) == []


def test_the_checks_catch_a_missing_and_a_stale_key() -> None:
    text = DOC.read_text()
    assert "launcher.ray_address" not in undocumented(text)
    without = re.sub(r"^\|\s*`ray_address`.*\n", "", text, flags=re.M)
    assert undocumented(without) == ["launcher.ray_address"]
    stale = text.replace("| `kind` |", "| `kindness` |", 1)
    assert unknown_in_tables(stale) == ["launcher: kindness"]
    # Every section is looked at: the roles keys come from RoleConfig, parallel.* included.
    assert "parallel.deepep_max_tokens_per_rank" in section_keys()["roles"]
    assert "model.enforce_eager" not in undocumented(text)
