"""Plain data (YAML mappings) <-> frozen dataclass trees, with errors that name the field.

Used by `orchestrator.config` to load `configs/*.yaml` and to apply `--set a.b=c` overrides.
Only the types the config tree uses are supported: bool, int, float, str, `Literal[...]`,
`tuple[str, ...]`, nested dataclasses and `Optional` of a nested dataclass. Anything else in a
dataclass here is a programming error and fails loudly (`TypeError`), not a user error.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Union

import yaml


class SchemaError(ValueError):
    """A YAML value or key does not fit the config tree; the message names the field and the fix."""


def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves the string annotations of `from __future__ import annotations`.
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None`; (tp, False) otherwise."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if optional:
        return f"{_type_name(inner)} or null"
    if typing.get_origin(inner) is Literal:
        return " | ".join(str(a) for a in typing.get_args(inner))
    if typing.get_origin(inner) is tuple:
        return "list of strings"
    if dataclasses.is_dataclass(inner):
        return "mapping"
    return getattr(inner, "__name__", str(inner))


def suggest(key: str, valid: list[str]) -> str:
    """' Did you mean X?' for the nearest valid key, or ''."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def unknown_key_message(key: str, where: str, valid: list[str],
                        top_level: tuple[str, ...] = ()) -> str:
    """The valid keys and the nearest one; a key of the root (`top_level`) met deeper, e.g.
    `speculative:` under `roles.decode:`, is a section in the wrong place, not a typo."""
    if where and key in top_level:
        return misplaced_section(key, where, "move it to the top level of the file")
    place = f"in '{where}'" if where else "at the top level"
    return f"unknown key '{key}' {place}. Valid keys: {', '.join(valid)}.{suggest(key, valid)}"


def misplaced_section(key: str, where: str, fix: str) -> str:
    return (f"'{key}' is a top-level section, not a key of '{where}' (one setting for every "
            f"role): {fix}")


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def convert(value: Any, tp: Any, path: str, top_level: tuple[str, ...] = ()) -> Any:
    """Check and convert one YAML value to the field type `tp`; `path` names it in errors;
    `top_level`: the root's keys (see unknown_key_message)."""
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise SchemaError(
            f"{path}: expected {_type_name(tp)}, got null. Give a value or remove the key."
        )
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            raise SchemaError(f"{path}: expected a mapping (a section with keys), got {value!r}")
        return build(inner, value, path, top_level)  # type: ignore[arg-type]
    if typing.get_origin(inner) is Literal:
        allowed = typing.get_args(inner)
        if isinstance(value, bool) and ("on" if value else "off") in allowed:
            value = "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if value not in allowed:
            options = " | ".join(str(a) for a in allowed)
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise SchemaError(f"{path}: must be one of {options}, got {value!r}.{hint}")
        return value
    if typing.get_origin(inner) is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SchemaError(f"{path}: expected a list of strings, got {value!r}")
        return tuple(value)
    if inner is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{path}: expected bool (true or false), got {value!r}")
        return value
    if inner is int:
        # bool is an int subclass in Python; `count: true` is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{path}: expected int, got {value!r} ({type(value).__name__})")
        return value
    if inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(
                f"{path}: expected float (a number), got {value!r} ({type(value).__name__})"
            )
        if value != value:  # NaN: it would pass every `<= 0` check, as no comparison holds
            raise SchemaError(f"{path}: expected a number, got nan")
        return float(value)
    if inner is str:
        if isinstance(value, (dict, list)):
            raise SchemaError(f"{path}: expected str, got {value!r}")
        # YAML types `8000` or `1.0` as numbers; for a string field the text is what was meant.
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)
    raise TypeError(f"schema: unsupported field type {tp!r} at {path}")


def build(cls: type, data: dict[str, Any], path: str = "",
          top_level: tuple[str, ...] = ()) -> Any:
    """Build dataclass `cls` from mapping `data`; missing keys take the dataclass defaults."""
    hints = _hints(cls)
    names = _field_names(cls)
    top_level = top_level or tuple(names)  # the root's keys, for errors deeper down
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in hints:
            raise SchemaError(unknown_key_message(str(key), path, names, top_level))
        kwargs[key] = convert(value, hints[key], f"{path}.{key}" if path else key, top_level)
    return cls(**kwargs)


def field_type(cls: type, dotted: str) -> Any:
    """The type of the field at `dotted` (e.g. 'roles.decode.count') under `cls`.

    Raises SchemaError naming the first unknown part, with the valid keys and a suggestion.
    """
    tp: Any = cls
    walked: list[str] = []
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        inner, _ = _unwrap_optional(tp)
        if not dataclasses.is_dataclass(inner):
            raise SchemaError(
                f"'{'.'.join(walked)}' is a value ({_type_name(tp)}), it has no key '{part}'"
            )
        hints = _hints(inner)  # type: ignore[arg-type]
        if part in _field_names(cls) and walked and part not in hints:
            raise SchemaError(misplaced_section(part, ".".join(walked),
                                                f"set {'.'.join(parts[i:])} instead"))
        if part not in hints:
            raise SchemaError(unknown_key_message(part, ".".join(walked), _field_names(inner)))
        tp = hints[part]
        walked.append(part)
    return tp


def parse_override(text: str, cls: type) -> tuple[list[str], Any]:
    """Parse one `a.b=c` override: (key path, value typed like YAML would type it).

    String fields keep the raw text (so `--set model.served_model_name=007` stays "007").
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SchemaError(f"--set {text!r}: expected KEY=VALUE, e.g. --set roles.decode.count=2")
    try:
        tp = field_type(cls, key)
    except SchemaError as exc:
        raise SchemaError(f"--set {text!r}: {exc}") from None
    inner, _ = _unwrap_optional(tp)
    if inner is str:
        return key.split("."), raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:  # one line: PyYAML's text spans several
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SchemaError(f"--set {text!r}: the value is not valid YAML ({what})") from None
    return key.split("."), value


def apply_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set data[k0][k1]...[kn] = value in place, creating sections on the way."""
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise SchemaError(
                f"--set {'.'.join(keys)}: '{'.'.join(keys[: i + 1])}' "
                "is not a section in the config file"
            )
        node = child
    node[keys[-1]] = value


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (YAML-safe), None sections dropped."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[f.name] = to_plain(value)
        return out
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj


_ROLE_SECTIONS = ("cache", "scheduler")  # a role's own, partial over the cluster's


def merge_role_sections(data: dict[str, Any]) -> None:
    """Per-role cache/scheduler sections are partial: complete them from the cluster's section."""
    roles = data.get("roles")
    if not isinstance(roles, dict):
        return
    for role in roles.values():
        if not isinstance(role, dict):
            continue
        for section in _ROLE_SECTIONS:
            base = data.get(section) or {}
            if isinstance(role.get(section), dict) and isinstance(base, dict):
                role[section] = {**base, **role[section]}


def partial_role_sections(plain: dict[str, Any]) -> dict[str, Any]:
    """`merge_role_sections` undone on a plain tree: each role's sections keep only the fields
    that differ from the cluster's (merging them again gives the same tree back)."""
    for role in (plain.get("roles") or {}).values():
        for section in _ROLE_SECTIONS:
            own, base = role.get(section), plain.get(section) or {}
            if isinstance(own, dict):
                role[section] = {k: v for k, v in own.items() if base.get(k) != v}
    return plain
