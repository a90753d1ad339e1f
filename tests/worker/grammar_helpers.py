"""Shared by the grammar tests that run the embedded model: a corpus of grammars whose every
path is finite (so each output must end with eos inside max_tokens), and checks of an output
against its grammar that do not use xgrammar (jsonschema, re)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
from tokenizers import Tokenizer

from tests.worker.grammar_tokenizers import EMBEDDED
from worker.sampling import StructuredKind, StructuredOutput

MAX_TOKENS = 240  # above the longest path of any grammar below

SCHEMAS: dict[str, dict[str, object]] = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
            "required": ["id", "tags"]},
        "meta": {"type": "object", "properties": {"v": {"const": 1}}, "required": ["v"]}},
        "required": ["user", "meta"]},
    "top_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 1, "maxItems": 4},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]},
        "mode": {"enum": ["x", None]}}, "required": ["color", "size", "mode"]},
    "patterns": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "var": {"type": "string", "pattern": "^[a-z]=[0-9]{2};$"}}, "required": ["code", "var"]},
    "refs_anyof": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
        "type": "object", "properties": {
            "p": {"$ref": "#/$defs/point"},
            "q": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50},
                            {"type": "string", "maxLength": 4}]}},
        "required": ["p", "q"]},
    "optional": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "string", "maxLength": 3}}, "required": ["a"]},
    "array_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "k": {"enum": ["p", "q"]}, "n": {"type": "integer", "minimum": 0, "maximum": 5}},
            "required": ["k", "n"]}}}, "required": ["items"]},
}

REGEX = r"[a-z]=[0-9]{2}(,[a-z]=[0-9]{2}){0,2};"
CHOICES = ("yes", "no", "maybe not")
EBNF = 'root ::= "answer: " value ";"\nvalue ::= [0-9] [0-9]? | "none"'
EBNF_REGEX = r"answer: ([0-9][0-9]?|none);"
LOOKUP = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]$"}},
          "required": ["name"]}
TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "call "},
    {"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
     # Without a bound, xgrammar's JSON content here allows any whitespace: a weak model loops.
     "content": {"type": "json_schema", "json_schema": LOOKUP, "max_whitespace_cnt": 1}}]}}
TAG_REGEX = r"call <tool_call>(.*)</tool_call>"


@dataclass(frozen=True)
class Case:
    name: str
    structured: StructuredOutput
    bias: str = ""  # characters whose token gets +20 (json_object: the model would not close)


def corpus() -> list[Case]:
    cases = [Case(f"json_schema:{n}", StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(s)))
             for n, s in SCHEMAS.items()]
    return cases + [
        Case("regex", StructuredOutput(StructuredKind.REGEX, REGEX)),
        Case("choice", StructuredOutput(StructuredKind.CHOICE, choices=CHOICES)),
        Case("ebnf", StructuredOutput(StructuredKind.EBNF, EBNF)),
        Case("structural_tag", StructuredOutput(StructuredKind.STRUCTURAL_TAG, json.dumps(TAG))),
        # Unsteered, the embedded model writes one endless key: a nudge to close strings.
        Case("json_object", StructuredOutput(StructuredKind.JSON_OBJECT), bias='"}'),
    ]


def logit_bias(tok: Tokenizer, case: Case) -> tuple[tuple[int, float], ...]:
    return tuple(sorted((tok.token_to_id(c), 20.0) for c in case.bias))


def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(EMBEDDED))


def check_output(case: Case, text: str) -> None:
    """The decoded output (eos excluded) matches the case's grammar; raises with the text."""
    s = case.structured
    if s.kind is StructuredKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), json.loads(s.text))  # strict json.loads: RFC 8259
    elif s.kind is StructuredKind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict), text
    elif s.kind is StructuredKind.REGEX:
        assert re.fullmatch(REGEX, text), text
    elif s.kind is StructuredKind.CHOICE:
        assert text in CHOICES, text
    elif s.kind is StructuredKind.EBNF:
        assert re.fullmatch(EBNF_REGEX, text), text
    else:
        match = re.fullmatch(TAG_REGEX, text, flags=re.S)
        assert match, text
        jsonschema.validate(json.loads(match.group(1)), LOOKUP)


def prompt(tok: Tokenizer, text: str = "m=87;y=42;n=60;\nm,n?") -> list[int]:
    return list(tok.encode(text).ids)
