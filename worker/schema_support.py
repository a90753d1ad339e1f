"""Which JSON-schema keywords the grammar engine (xgrammar 0.2.9) enforces; the rest refused.

xgrammar's schema converter drops some keywords without a word (or with a log line): the
output may then break them (`uniqueItems` gives `[1, 1]`, `not` is ignored, a second `allOf`
branch is ignored, `oneOf` becomes `anyOf`, a `pattern` beside `maxLength` loses the length,
...). The API's rule is that a field it accepts is honoured or refused, so `check_schema` walks
a schema before it is compiled and raises `SchemaUnsupported` naming the first such keyword and
where it sits (a JSON pointer). tests/worker/test_schema_support.py holds, for every refusal,
an output that violates the schema and that xgrammar's grammar accepts: the reason it exists.

Refused: `not`, `if`/`then`/`else`, `dependentRequired`, `dependentSchemas`, `dependencies`,
`contains` (and `minContains`/`maxContains`), `unevaluatedItems`, dynamic refs,
`uniqueItems: true`, `multipleOf` except on `"type": "integer"` with an integer step,
`allOf` with more than one branch or beside other assertions, `anyOf`/`oneOf` beside other
assertions, `oneOf` whose branches are not provably disjoint (by type, by const/enum values,
or by a required property's const/enum in object branches), `$ref` other than `#` / `#/...` or
beside other assertions, `enum`/`const` beside assertions other than a `type` that all values
match, a `format` xgrammar does not know or beside `pattern`/`minLength`/`maxLength`, a
`pattern` beside `minLength`/`maxLength`, a lookahead in a pattern, a `required` name that
`properties` does not declare, a `patternProperties` regex that matches a declared property
(both schemas apply; xgrammar holds it to `properties` alone), and nesting deeper than
`MAX_DEPTH` subschemas (xgrammar's grammar grows with the square of the depth: 400 levels took
~18 s to compile).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

ENGINE = "xgrammar 0.2.9"
MAX_DEPTH = 64  # subschema levels; 64 compile in ~0.03 s, 400 in ~18 s (dev box)

# Keywords xgrammar ignores wherever they appear.
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
            "dependencies", "contains", "minContains", "maxContains", "unevaluatedItems",
            "$dynamicRef", "$recursiveRef")
# Formats xgrammar compiles into the grammar (each checked in the tests).
KNOWN_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# JSON Schema's assertion and applicator keywords; anything else is an annotation (title,
# description, default, examples, $defs, ...), which validators ignore as well.
_ASSERTIONS = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "minLength",
    "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref",
    "unevaluatedProperties", *_IGNORED})
# Where subschemas sit: a keyword holding one, a mapping of them, or a list of them.
_ONE = ("additionalProperties", "propertyNames", "items", "additionalItems",
        "unevaluatedProperties")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")


class SchemaUnsupported(ValueError):
    """The schema uses a keyword the engine would not enforce; the message names it."""


def check_schema(schema: Any) -> None:
    """Raise `SchemaUnsupported` when the engine cannot honour all of `schema`."""
    _Walker(schema).visit(schema, "#", 0)


def check_structural_tag(tag: Any) -> None:
    """The same check for every JSON-schema element of a structural tag."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            check_schema(tag["json_schema"])
            return
        for value in tag.values():
            check_structural_tag(value)
    elif isinstance(tag, list):
        for value in tag:
            check_structural_tag(value)


def _refuse(keyword: str, at: str, why: str) -> SchemaUnsupported:
    return SchemaUnsupported(f"`{keyword}` at {at} is not enforced by this server's grammar "
                             f"engine ({ENGINE}): {why}")


def _pointer(at: str, *keys: object) -> str:
    return at + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)


class _Walker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def visit(self, s: Any, at: str, depth: int) -> None:
        if not isinstance(s, dict):  # true / false; anything else is xgrammar's to refuse
            return
        if depth > MAX_DEPTH:
            raise SchemaUnsupported(f"the schema is nested deeper than {MAX_DEPTH} subschemas "
                                    f"(at {at}); flatten it or use $defs with $ref")
        self.check(s, at)
        for sub, where in _subschemas(s, at):
            self.visit(sub, where, depth + 1)

    def check(self, s: dict[str, Any], at: str) -> None:
        for kw in _IGNORED:
            if kw in s:
                raise _refuse(kw, at, "the output could break it; remove it and check the "
                              "output yourself")
        if s.get("uniqueItems") is True:
            raise _refuse("uniqueItems", at, "items could repeat; remove it")
        if "multipleOf" in s and not (s.get("type") == "integer" and _is_int(s["multipleOf"])):
            raise _refuse("multipleOf", at, 'only an integer step on "type": "integer" is')
        self._combinators(s, at)
        self._values(s, at)
        self._strings(s, at)
        props = s.get("properties")
        declared = props if isinstance(props, dict) else {}
        for pattern, sub in (s.get("patternProperties") or {}).items():
            hit = next((n for n in declared if _matches(pattern, n)), None)
            if hit is not None and sub not in (True, {}):
                raise _refuse("patternProperties", at, f"{pattern!r} also matches the declared "
                              f"property {hit!r}, which would be held to `properties` alone; "
                              "make the pattern skip it")
        for name in s.get("required") or ():
            if isinstance(name, str) and name not in declared:
                raise _refuse("required", at, f"{name!r} is not under `properties`, so it is "
                              "never written; declare it there")

    def _combinators(self, s: dict[str, Any], at: str) -> None:
        for kw in ("allOf", "anyOf", "oneOf", "$ref"):
            if kw in s and _assertions(s) - {kw}:
                others = ", ".join(sorted(_assertions(s) - {kw}))
                raise _refuse(kw, at, f"beside {others} one of the two is ignored; move the "
                              f"other keywords into each branch")
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            raise _refuse("allOf", at, "only its first branch would hold; merge the branches "
                          "into one schema")
        ref = s.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            raise _refuse("$ref", at, f"{ref!r} is not resolved (only '#' and '#/...' "
                          "pointers into this schema are); the value would be unconstrained")
        branches = s.get("oneOf")
        if isinstance(branches, list):
            for i in range(len(branches)):
                for j in range(i):
                    if not self._disjoint(branches[j], branches[i]):
                        raise _refuse("oneOf", at, f"branches {j} and {i} could both match, "
                                      "and exactly-one is not enforced; use anyOf, or tell "
                                      "branches apart by type or by a const")

    def _values(self, s: dict[str, Any], at: str) -> None:
        for kw in ("enum", "const"):
            if kw not in s:
                continue
            others = _assertions(s) - {"enum", "const", "type"}
            if others:
                raise _refuse(kw, at, f"beside it {', '.join(sorted(others))} is ignored; list "
                              "only values that satisfy them")
            values = s["enum"] if kw == "enum" else [s["const"]]
            allowed = _declared_types(s)
            if allowed is not None and isinstance(values, list):
                for v in values:
                    if not _type_of(v) & allowed:
                        raise _refuse(kw, at, f"the value {json.dumps(v)[:40]} is not of "
                                      "its `type`, which is ignored beside it")

    def _strings(self, s: dict[str, Any], at: str) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in s]
        types = _declared_types(s)
        if "format" in s and (types is None or "string" in types):
            fmt = s["format"]
            if fmt not in KNOWN_FORMATS:
                raise _refuse("format", at, f"{fmt!r} is not one it knows "
                              f"({', '.join(sorted(KNOWN_FORMATS))})")
            if "pattern" in s or lengths:
                raise _refuse("format", at, "beside pattern/minLength/maxLength those are "
                              "ignored; use a pattern alone")
        if "pattern" in s and lengths:
            raise _refuse("pattern", at, f"beside it {', '.join(lengths)} is ignored; put the "
                          "length into the pattern")
        patterns = [("pattern", s.get("pattern"))]
        patterns += [("patternProperties", k) for k in s.get("patternProperties") or ()]
        for kw, p in patterns:
            if isinstance(p, str) and _has_lookahead(p):
                raise _refuse(kw, at, f"the lookahead in {p[:40]!r} is ignored; write the "
                              "pattern without (?= or (?!")

    # ---- oneOf: proofs that two branches never match the same value ----------------------------
    def _resolve(self, s: Any, hops: int = 0) -> Any:
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and hops < 16:
            s, hops = _lookup(self.root, s["$ref"]), hops + 1
        return s

    def _disjoint(self, a: Any, b: Any) -> bool:
        a, b = self._resolve(a), self._resolve(b)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        ta, tb = _types(a), _types(b)
        if ta is not None and tb is not None and not ta & tb:
            return True
        va, vb = _values(a), _values(b)
        if va is not None and vb is not None and not va & vb:
            return True
        if ta == tb == {"object"}:  # a discriminator: a required property's values differ
            for name in set(a.get("required") or ()) & set(b.get("required") or ()):
                pa = self._resolve((a.get("properties") or {}).get(name))
                pb = self._resolve((b.get("properties") or {}).get(name))
                va = _values(pa) if isinstance(pa, dict) else None
                vb = _values(pb) if isinstance(pb, dict) else None
                if va is not None and vb is not None and not va & vb:
                    return True
        return False


def _subschemas(s: dict[str, Any], at: str) -> Iterator[tuple[Any, str]]:
    for kw in _ONE:
        if isinstance(s.get(kw), dict):
            yield s[kw], _pointer(at, kw)
    for kw in _MAP:
        if isinstance(s.get(kw), dict):
            for name, sub in s[kw].items():
                yield sub, _pointer(at, kw, name)
    for kw in _LIST:
        if isinstance(s.get(kw), list):
            for i, sub in enumerate(s[kw]):
                yield sub, _pointer(at, kw, i)


def _assertions(s: dict[str, Any]) -> set[str]:
    return {k for k in s if k in _ASSERTIONS}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_of(v: Any) -> set[str]:
    """The JSON types a value belongs to (an integral number is both integer and number)."""
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if _is_int(v) or (isinstance(v, float) and v.is_integer()):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    return {"string" if isinstance(v, str) else "array" if isinstance(v, list) else "object"}


def _types(s: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema's instances may have (None: any); number includes integer."""
    if "const" in s:
        return _type_of(s["const"])
    if isinstance(s.get("enum"), list):
        return set().union(*(_type_of(v) for v in s["enum"]))
    return _declared_types(s)


def _declared_types(s: dict[str, Any]) -> set[str] | None:
    """The types its `type` keyword names (None: no `type`); number includes integer."""
    t = s.get("type")
    names = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if names is not None and "number" in names:
        names.add("integer")
    return names


def _values(s: dict[str, Any]) -> set[str] | None:
    """A schema's allowed values as canonical JSON (None: not a const/enum)."""
    values = [s["const"]] if "const" in s else s.get("enum")
    if not isinstance(values, list):
        return None
    return {json.dumps(int(v) if isinstance(v, float) and v.is_integer() else v,
                       sort_keys=True) for v in values}


def _lookup(root: Any, ref: str) -> Any:
    """A '#/...' pointer into the root schema (None when it leads nowhere)."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _matches(pattern: str, name: str) -> bool:
    """Whether a patternProperties regex matches a property name (Python's `re` reads the
    usual JSON-schema regexes alike; one it cannot read is left to the engine)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _has_lookahead(pattern: str) -> bool:
    """A `(?=` or `(?!` group outside a character class (escapes skipped)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
        i += 1
    return False
