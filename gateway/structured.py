"""Structured-output requests → the wire's `StructuredOutput` (compiled by the worker).

Sources, at most one per request: OpenAI's `response_format` (json_object, json_schema,
plus vLLM / SGLang's structural_tag), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (EBNF, xgrammar's dialect with rule `root`), vLLM's newer
`structured_outputs` object, and a forced tool call (tool_choice "required" or named, built by
gateway/agents.py). Two at once is a 400: which one would win is not the client's guess. A
JSON `response_format` beside a forced call is not a second one: it shapes a text answer, and
the forced turn is calls (OpenAI's reading; vLLM's too).
Tools under tool_choice "auto" are not a second constraint: `strict` ones alone allow free text
with calls held to their schemas; beside one, any tools make the output either calls or the
constrained answer (`StrictCalls`), as OpenAI lets a model call tools before its formatted
answer.

With a reasoning parser on, the constraint starts after the `<think>` block: the request is
sent as a structural tag whose first element lets the block through unconstrained (none when
the prompt already closed the block: thinking off, the answer comes at once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import BadRequest
from gateway.parsers.constraints import json_element, structural_tag
from protocol import tandem_pb2


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint, before it is put on the wire."""

    source: str  # the request field that asked for it (named in errors)
    kind: str  # json_schema | json_object | regex | choice | ebnf | structural_tag
    schema: Any = None  # json_schema: the schema (a mapping or a boolean)
    text: str = ""  # regex / ebnf
    choices: tuple[str, ...] = ()  # choice
    format: dict[str, Any] | None = None  # structural_tag: the xgrammar format object

    def as_format(self) -> dict[str, Any]:
        """The same constraint as a structural-tag format element (to follow a think block)."""
        if self.kind == "json_schema":
            return json_element(self.schema)
        if self.kind == "json_object":
            return json_element({"type": "object"})
        if self.kind == "regex":
            return {"type": "regex", "pattern": self.text}
        if self.kind == "ebnf":
            return {"type": "grammar", "grammar": self.text}
        if self.kind == "choice":
            return {"type": "or", "elements": [{"type": "const_string", "value": c}
                                               for c in self.choices]}
        assert self.format is not None
        return self.format

    def to_proto(self, prefix: list[dict[str, Any]]) -> tandem_pb2.StructuredOutput:
        """The wire form; `prefix` (a reasoning block) makes it a structural tag."""
        try:
            return self._proto(prefix)
        except ValueError as exc:  # NaN / Infinity inside a schema: not JSON, not compilable
            raise BadRequest(f"{self.source}: the schema holds a value JSON cannot carry "
                             f"({exc}); send finite numbers", param=self.source) from None

    def _proto(self, prefix: list[dict[str, Any]]) -> tandem_pb2.StructuredOutput:
        if prefix or self.kind == "structural_tag":
            return tandem_pb2.StructuredOutput(structural_tag=structural_tag(
                [*prefix, self.as_format()]))
        if self.kind == "json_schema":
            return tandem_pb2.StructuredOutput(json_schema=json.dumps(
                self.schema, ensure_ascii=False, allow_nan=False))
        if self.kind == "json_object":
            return tandem_pb2.StructuredOutput(json_object=True)
        if self.kind == "regex":
            return tandem_pb2.StructuredOutput(regex=self.text)
        if self.kind == "ebnf":
            return tandem_pb2.StructuredOutput(ebnf=self.text)
        return tandem_pb2.StructuredOutput(choice=tandem_pb2.ChoiceList(choices=self.choices))


@dataclass(frozen=True)
class StrictCalls:
    """Tools under tool_choice "auto", as structural-tag formats
    (gateway/parsers/constraints.py): `anywhere`, free text with calls held to their schemas;
    `block`, calls alone (the alternative to another constraint's answer). `alone`: a tool is
    `strict`, so the calls are held even with no other constraint; without one, only beside
    another constraint (which would otherwise leave the tools no way to be called)."""

    anywhere: dict[str, Any]
    block: dict[str, Any]
    alone: bool = True


def _schema(value: Any, field: str) -> Any:
    """A JSON schema given as a mapping, a boolean, or JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(value, (dict, bool)):
        raise BadRequest(f"{field} must be a JSON schema (an object)", param=field)
    return value


def _choices(values: list[str], field: str) -> tuple[str, ...]:
    if not values or not all(values):
        raise BadRequest(f"{field} must list at least one non-empty string", param=field)
    return tuple(values)


def _legacy_structural_tag(structures: list[dict[str, Any]], triggers: list[str],
                           field: str) -> dict[str, Any]:
    """SGLang / vLLM's first structural-tag form as xgrammar's triggered_tags format."""
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not {"begin", "end"} <= s.keys():
            raise BadRequest(f"{field}.structures[{i}] needs begin, schema and end",
                             param=field)
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s.get("schema", True)}})
    if not triggers:
        raise BadRequest(f"{field}.triggers must name at least one trigger", param=field)
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


# The fields each response_format type reads; another type's field set beside it is refused
# (a json_schema sent with type json_object would never be enforced).
_RF_FIELDS = {"text": (), "json_object": (), "json_schema": ("json_schema",),
              "structural_tag": ("format", "structures", "triggers")}


def _check_response_format(rf: Any) -> None:
    for name in ("json_schema", "format", "structures", "triggers"):
        if getattr(rf, name) is not None and name not in _RF_FIELDS[rf.type]:
            raise BadRequest(f"response_format.{name} does not go with type {rf.type!r}, which "
                             f"would ignore it; remove it or send the type that reads it",
                             param="response_format")
    if rf.format is not None and (rf.structures is not None or rf.triggers is not None):
        raise BadRequest("response_format: send `format` or `structures` and `triggers`, not "
                         "both (one would be ignored)", param="response_format")


def _from_response_format(req: Any) -> Constraint | None:
    rf = req.response_format
    if rf is not None:
        _check_response_format(rf)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint("response_format", "json_object")
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise BadRequest("response_format.json_schema.schema is required for type "
                             "json_schema", param="response_format")
        return Constraint("response_format", "json_schema",
                          schema=_schema(rf.json_schema.json_schema, "response_format"))
    if rf.format is not None:
        return Constraint("response_format", "structural_tag", format=rf.format)
    if rf.structures is not None:
        return Constraint("response_format", "structural_tag", format=_legacy_structural_tag(
            rf.structures, rf.triggers or [], "response_format"))
    raise BadRequest("response_format type structural_tag needs `format` (or `structures` and "
                     "`triggers`)", param="response_format")


def _from_structured_outputs(req: Any) -> list[Constraint]:
    so = req.structured_outputs
    if so is None:
        return []
    f = "structured_outputs"
    if so.disable_any_whitespace or so.disable_additional_properties or so.whitespace_pattern:
        raise BadRequest(f"{f}: disable_any_whitespace, disable_additional_properties and "
                         "whitespace_pattern are not supported; omit them", param=f)
    found = []
    if so.json_ is not None:
        found.append(Constraint(f, "json_schema", schema=_schema(so.json_, f"{f}.json")))
    if so.regex is not None:
        found.append(Constraint(f, "regex", text=so.regex))
    if so.choice is not None:
        found.append(Constraint(f, "choice", choices=_choices(so.choice, f"{f}.choice")))
    if so.grammar is not None:
        found.append(Constraint(f, "ebnf", text=so.grammar))
    if so.json_object:
        found.append(Constraint(f, "json_object"))
    if so.structural_tag is not None:
        tag = _schema(so.structural_tag, f"{f}.structural_tag")
        fmt = tag.get("format") if isinstance(tag, dict) else None
        if fmt is None and isinstance(tag, dict) and "structures" in tag:
            fmt = _legacy_structural_tag(tag["structures"], tag.get("triggers", []), f)
        if not isinstance(fmt, dict):
            raise BadRequest(f"{f}.structural_tag needs a `format` object", param=f)
        found.append(Constraint(f, "structural_tag", format=fmt))
    if not found:
        raise BadRequest(f"{f} names no constraint; set one of json, regex, choice, grammar, "
                         "json_object, structural_tag", param=f)
    return found


def request_constraint(req: Any, forced_tools: Constraint | None = None,
                       strict_calls: StrictCalls | None = None) -> Constraint | None:
    """The one constraint a request asks for (None: unconstrained); 400 when it asks for two.
    `strict_calls` join it: alone, or as the alternative to the one constraint's answer."""
    text_format = _from_response_format(req)
    if forced_tools and text_format and text_format.kind in ("json_object", "json_schema"):
        # A forced turn is calls, and a JSON response_format shapes a text answer, which that
        # turn has none of (OpenAI's reading; an agent framework sends both). Parsed (a
        # malformed one is still a 400), then unused.
        text_format = None
    found = [c for c in (text_format, forced_tools) if c is not None]
    if req.guided_json is not None:
        found.append(Constraint("guided_json", "json_schema",
                                schema=_schema(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(Constraint("guided_regex", "regex", text=req.guided_regex))
    if req.guided_choice is not None:
        found.append(Constraint("guided_choice", "choice",
                                choices=_choices(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(Constraint("guided_grammar", "ebnf", text=req.guided_grammar))
    found.extend(_from_structured_outputs(req))
    for c in found:
        if c.kind in ("regex", "ebnf") and not c.text:
            raise BadRequest(f"{c.source} is empty; send a pattern / grammar", param=c.source)
    if len(found) > 1:
        names = ", ".join(sorted({c.source for c in found}))
        raise BadRequest(f"only one output constraint per request; got {names}",
                         param=found[1].source)
    if strict_calls is None or not (found or strict_calls.alone):
        return found[0] if found else None
    if not found:
        return Constraint("tools", "structural_tag", format=strict_calls.anywhere)
    answer = found[0]
    return Constraint(answer.source, "structural_tag", format={
        "type": "or", "elements": [strict_calls.block, answer.as_format()]})
