"""Grammars, as xgrammar structural-tag JSON, that force output into a parser's format.

The gateway never imports xgrammar: it writes the structural tag as text and the worker
compiles it (`Grammar.from_structural_tag`). Used for `tool_choice` "required" / a named
function (the output is one or more well-formed calls in the configured tool-call parser's
own format, each call's arguments matching that tool's JSON schema: `tool_calls_format`), for
`strict` tools under "auto" (free text, and wherever the format's call marker appears a call
held to its tool's schema: `auto_calls_format`), and to let a model's `<think>` block come
before any constrained output when a reasoning parser is on.

A marker that is a special token of the model's vocabulary (Mistral's `[TOOL_CALLS]`, for
one) is written as a `{"type": "token"}` element: xgrammar never lets a special token match
text, so spelling it out would force the model to write it character by character.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.parsers.reasoning import THINK_CLOSE, THINK_OPEN

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_WHITESPACE: dict[str, Any] = {"type": "regex", "pattern": "[ \\n\\t]{0,8}"}  # bounded: no loop


def json_element(schema: Any, style: str = "json") -> dict[str, Any]:
    """A structural tag's JSON-schema element. JSON in a tag allows free whitespace unless told
    (xgrammar's `max_whitespace_cnt`; 0 is refused): at most one character at a time keeps it
    near the plain path's compact layout, and a weak model cannot loop on spaces there. The
    same holds for the XML style (qwen3_coder) between and around its parameters; a string
    value's own text stays free there."""
    element = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return element if style == "json" else {**element, "style": style}


@dataclass(frozen=True)
class CallFormat:
    """How one tool-call format writes its calls; `{name}` stands for the tool's name."""

    prefix: tuple[str, ...]  # before the arguments (markers are separate pieces)
    suffix: tuple[str, ...]  # after the arguments
    separator: tuple[str, ...] = ()  # between two calls
    open: tuple[str, ...] = ()  # once, before the first call
    close: tuple[str, ...] = ()  # once, after the last call
    style: str = "json"  # xgrammar's JSONSchemaFormat style for the arguments


_DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
       "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")

CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(prefix=("<tool_call>", '\n{"name": "{name}", "arguments": '),
                         suffix=("}\n", "</tool_call>"), separator=("\n",)),
    "qwen3_coder": CallFormat(prefix=("<tool_call>", "\n<function={name}>\n"),
                              suffix=("\n</function>\n", "</tool_call>"), separator=("\n",),
                              style="qwen_xml"),
    "llama3_json": CallFormat(prefix=('{"name": "{name}", "parameters": ',), suffix=("}",),
                              separator=("; ",)),
    "mistral": CallFormat(prefix=('{"name": "{name}", "arguments": ',), suffix=("}",),
                          separator=(", ",), open=("[TOOL_CALLS]", "["), close=("]",)),
    # v11+ Mistral tokenizers (a vocabulary with `[ARGS]`): `[TOOL_CALLS]name[ARGS]{...}`.
    "mistral_v11": CallFormat(prefix=("[TOOL_CALLS]", "{name}", "[ARGS]"), suffix=()),
    "deepseek_v3": CallFormat(prefix=(_DS[2], "function", _DS[4], "{name}\n```json\n"),
                              suffix=("\n```", _DS[3]), separator=("\n",), open=(_DS[0],),
                              close=(_DS[1],)),
    "deepseek_v31": CallFormat(prefix=(_DS[2], "{name}", _DS[4]), suffix=(_DS[3],),
                               open=(_DS[0],), close=(_DS[1],)),
}
CALL_FORMATS["qwen3"] = CALL_FORMATS["hermes"]


class Pieces:
    """Turns format pieces into structural-tag elements, special tokens as token elements."""

    def __init__(self, special_tokens: Collection[str]) -> None:
        self.special = special_tokens

    def elements(self, pieces: tuple[str, ...], name: str = "") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in pieces:
            if p in self.special:
                out.append({"type": "token", "token": p})
                continue
            text = p.replace("{name}", name)
            if not text:
                continue
            if out and out[-1]["type"] == "const_string":
                out[-1] = {"type": "const_string", "value": out[-1]["value"] + text}
            else:
                out.append({"type": "const_string", "value": text})
        return out

    def one(self, piece: str) -> str | dict[str, Any]:
        """A single marker as a tag's begin / end: the text, or its token."""
        return {"type": "token", "token": piece} if piece in self.special else piece


def _sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _call(fmt: CallFormat, pieces: Pieces, tools: Sequence[tuple[str, dict[str, Any] | None]],
          skip: int = 0) -> dict[str, Any]:
    """One call to any of `tools`, less the first `skip` pieces of its prefix and the last
    `skip` of its suffix (a triggered tag's begin and end)."""
    options = []
    for name, schema in tools:
        args = json_element(schema or _NO_PARAMETERS, fmt.style)
        suffix = fmt.suffix[: len(fmt.suffix) - skip]
        options.append(_sequence([*pieces.elements(fmt.prefix[skip:], name), args,
                                  *pieces.elements(suffix, name)]))
    return options[0] if len(options) == 1 else {"type": "or", "elements": options}


def _calls(fmt: CallFormat, pieces: Pieces, tools: Sequence[tuple[str, dict[str, Any] | None]],
           parallel: bool) -> list[dict[str, Any]]:
    """One call, or with `parallel` one or more separated as the format separates them."""
    call = _call(fmt, pieces, tools)
    if not parallel:
        return [call]
    return [call, {"type": "star", "content": _sequence([*pieces.elements(fmt.separator),
                                                          call])}]


def tool_calls_format(parser: str, tools: Sequence[tuple[str, dict[str, Any] | None]],
                      parallel: bool, special_tokens: Collection[str]) -> dict[str, Any]:
    """A format accepting one call (or, with `parallel`, one or more) to any of `tools`
    (name, parameters schema), written the way `parser` reads them."""
    fmt = CALL_FORMATS[parser]
    pieces = Pieces(special_tokens)
    return _sequence([*pieces.elements(fmt.open), *_calls(fmt, pieces, tools, parallel),
                      *pieces.elements(fmt.close)])


def auto_calls_format(parser: str, tools: Sequence[tuple[str, dict[str, Any] | None]],
                      parallel: bool, special_tokens: Collection[str]) -> dict[str, Any]:
    """Free text in which the format's call marker (its calls block's opening, or a call's
    first piece) starts calls to `tools` held to their schemas: xgrammar's triggered tags
    (token-triggered when the marker is a special token). A format whose calls open with the
    tool's name (llama3_json) triggers on the text before the name, one tag a tool."""
    fmt = CALL_FORMATS[parser]
    pieces = Pieces(special_tokens)
    once = not parallel
    if fmt.open:  # one block of calls: [open...] calls [...close]
        begin, end = fmt.open[0], fmt.close[-1]
        content = _sequence([*pieces.elements(fmt.open[1:]), *_calls(fmt, pieces, tools,
                                                                      parallel),
                             *pieces.elements(fmt.close[:-1])])
        once = True
    elif "{name}" in fmt.prefix[0]:  # `{"name": "<tool>", ...`: the tool's name is in the begin
        tags = [{"type": "tag", "begin": fmt.prefix[0].replace("{name}", name),
                 "content": _call(fmt, pieces, [(name, schema)], skip=1), "end": fmt.suffix[-1]}
                for name, schema in tools]
        return {"type": "triggered_tags", "triggers": [fmt.prefix[0].split("{name}")[0]],
                "tags": tags, "stop_after_first": once}
    else:  # each call its own tag
        begin, end = fmt.prefix[0], fmt.suffix[-1] if fmt.suffix else ""
        content = _call(fmt, pieces, tools, skip=1)
    tag = {"type": "tag", "begin": pieces.one(begin), "content": content,
           "end": pieces.one(end) if end else ""}
    if begin in pieces.special:
        return {"type": "token_triggered_tags", "trigger_tokens": [begin], "tags": [tag],
                "stop_after_first": once}
    return {"type": "triggered_tags", "triggers": [begin], "tags": [tag],
            "stop_after_first": once}


def reasoning_prefix(parser: str, starts_in_reasoning: bool,
                     special_tokens: Collection[str],
                     closed_in_prompt: bool = False) -> list[dict[str, Any]]:
    """Elements that let the reasoning block come first (empty list: no reasoning parser, or
    `closed_in_prompt`: the template wrote an empty block, thinking off; a model that always
    reasons, deepseek_r1, keeps its block as its parser expects one)."""
    if not parser or (closed_in_prompt and parser != "deepseek_r1"):
        return []
    pieces = Pieces(special_tokens)
    end = pieces.one(THINK_CLOSE)
    if starts_in_reasoning or parser == "deepseek_r1":
        # Already inside the block (or a model that always reasons): text up to `</think>`.
        block: dict[str, Any] = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                                 "end": end}
    else:
        block = {"type": "optional", "content": {
            "type": "tag", "begin": pieces.one(THINK_OPEN), "content": {"type": "any_text"},
            "end": end}}
    return [block, _WHITESPACE]


def structural_tag(elements: list[dict[str, Any]]) -> str:
    """The structural-tag JSON text the wire's `StructuredOutput.structural_tag` carries.
    Raises ValueError for values JSON cannot carry (NaN or infinite numbers in a schema)."""
    return json.dumps({"type": "structural_tag", "format": _sequence(elements)},
                      ensure_ascii=False, allow_nan=False)
