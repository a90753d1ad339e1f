"""JSON-schema keywords the grammar engine does not enforce are refused, never dropped.

Each refused case carries an output that violates the schema and that xgrammar 0.2.9's own
grammar for it accepts: the proof that honouring the request is impossible today. If a later
xgrammar starts enforcing one, its `xgrammar_accepts` check fails: lift the refusal then.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from tests.worker.grammar_tokenizers import embedded
from worker.grammar_xgr import GrammarBackend, tokenizer_info
from worker.sampling import GrammarError, StructuredKind, StructuredOutput

INT = {"type": "integer"}
AB = {"a": INT, "b": INT}


def obj(**kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": AB, **kw}


# name -> (schema, an output that violates it, the keyword the refusal names)
REFUSED: dict[str, tuple[Any, str, str]] = {
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]",
                    "uniqueItems"),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 3}}, "[1]", "contains"),
    "not": ({"not": INT}, "1", "not"),
    "if_then": (obj(**{"if": {"required": ["a"]}, "then": {"required": ["b"]}}), '{"a": 1}',
                "if"),
    "dependentRequired": (obj(dependentRequired={"a": ["b"]}), '{"a": 1}',
                          "dependentRequired"),
    "dependentSchemas": (obj(dependentSchemas={"a": {"required": ["b"]}}), '{"a": 1}',
                         "dependentSchemas"),
    "multipleOf_number": ({"type": "number", "multipleOf": 0.25}, "0.3", "multipleOf"),
    "multipleOf_untyped": ({"multipleOf": 3}, "4", "multipleOf"),
    "allOf_two": ({"allOf": [obj(required=["a"]), obj(required=["b"])]}, '{"a": 1}', "allOf"),
    "allOf_beside": (obj(allOf=[{"required": ["a"]}]), "{}", "allOf"),
    "anyOf_beside": ({"type": "integer", "anyOf": [{"minimum": 5}]}, "4", "anyOf"),
    "oneOf_overlap": ({"oneOf": [INT, {"type": "number"}]}, "1", "oneOf"),
    "ref_sibling": ({"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 5}, "4", "$ref"),
    "ref_anchor": ({"$defs": {"x": {"$anchor": "X", "type": "integer"}}, "$ref": "#X"}, '"s"',
                   "$ref"),
    "enum_beside": ({"enum": ["a", "bbb"], "minLength": 2}, '"a"', "enum"),
    "const_type": ({"type": "integer", "const": "x"}, '"x"', "const"),
    "format_unknown": ({"type": "string", "format": "idn-email"}, '"x"', "format"),
    "format_pattern": ({"type": "string", "format": "email", "pattern": "^a"}, '"b@c.de"',
                       "format"),
    "format_length": ({"type": "string", "format": "email", "maxLength": 3}, '"bb@c.de"',
                      "format"),
    "pattern_length": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"',
                       "pattern"),
    "pattern_lookahead": ({"type": "string", "pattern": "^(?!b)[ab]$"}, '"b"', "pattern"),
    "required_undeclared": ({"type": "object", "required": ["x"]}, "{}", "required"),
    "pattern_and_property": ({"type": "object", "properties": {"a1": INT},
                              "patternProperties": {"^a": {"type": "boolean"}}}, '{"a1": 1}',
                             "patternProperties"),
    "nested": ({"type": "object", "properties": {"xs": {"type": "array", "items": INT,
                                                        "uniqueItems": True}}},
               '{"xs": [1, 1]}', "uniqueItems"),
}

# Schemas the engine does enforce (pydantic's and OpenAI's usual shapes among them): accepted.
ACCEPTED: dict[str, Any] = {
    "pydantic_ref_with_description": {"$defs": {"X": INT}, "allOf": [{"$ref": "#/$defs/X"}],
                                      "description": "d"},
    "ref_with_annotations": {"$defs": {"X": INT}, "$ref": "#/$defs/X", "title": "t"},
    "nullable_anyof": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
    "oneOf_by_type": {"oneOf": [INT, {"type": "string"}, {"type": "null"}]},
    "oneOf_by_const": {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
    "oneOf_discriminated": {"$defs": {
        "Cat": {"type": "object", "properties": {"k": {"const": "cat"}}, "required": ["k"]},
        "Dog": {"type": "object", "properties": {"k": {"const": "dog"}}, "required": ["k"]}},
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
    "enum_with_type": {"type": "string", "enum": ["a", "b"]},
    "multipleOf_integer": {"type": "integer", "multipleOf": 7},
    "format_alone": {"type": "string", "format": "date-time"},
    "recursive": {"type": "object", "properties": {"kids": {"type": "array",
                                                            "items": {"$ref": "#"}}}},
    "uniqueItems_false": {"type": "array", "items": INT, "uniqueItems": False},
    "pattern_alone": {"type": "string", "pattern": "^[a-z]{2,4}$"},
    "pattern_beside_property": {"type": "object", "properties": {"b": INT},
                                "patternProperties": {"^a": {"type": "boolean"}, "^b": {}}},
    "required_declared": obj(required=["a", "b"], additionalProperties=False),
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tok = embedded()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return GrammarBackend(tokenizer_info(tok.to_str(), vocab, [0]))


def compile_schema(backend: GrammarBackend, schema: Any) -> None:
    backend.compile(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema)))


@pytest.mark.parametrize("name", list(REFUSED))
def test_xgrammar_accepts_the_violation(name: str) -> None:
    """Why each refusal exists: the engine's grammar lets through an output the schema forbids."""
    schema, bad, _ = REFUSED[name]
    checker = jsonschema.FormatChecker()
    assert not jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(
        json.loads(bad))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           strict_mode=True)
    assert _is_grammar_accept_string(grammar, bad)


@pytest.mark.parametrize("name", list(REFUSED))
def test_unenforced_keyword_is_refused_naming_it(backend: GrammarBackend, name: str) -> None:
    schema, _, keyword = REFUSED[name]
    with pytest.raises(GrammarError) as err:
        compile_schema(backend, schema)
    message = str(err.value)
    assert message.startswith("sampling.structured.json_schema: ") and f"`{keyword}`" in message
    assert "not enforced" in message


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_inside_a_structural_tag(backend: GrammarBackend, name: str) -> None:
    """The gateway sends a response_format behind a <think> block, and forced tool calls, as
    structural tags with JSON-schema elements: the same check reaches them."""
    schema, _, keyword = REFUSED[name]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "x"},
        {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}]}}
    with pytest.raises(GrammarError) as err:
        backend.compile(StructuredOutput(StructuredKind.STRUCTURAL_TAG, json.dumps(tag)))
    assert str(err.value).startswith("sampling.structured.structural_tag: ")
    assert f"`{keyword}`" in str(err.value)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_enforced_schemas_still_compile(backend: GrammarBackend, name: str) -> None:
    compile_schema(backend, ACCEPTED[name])


def test_deep_nesting_is_refused_before_it_stalls_the_compiler(backend: GrammarBackend) -> None:
    """xgrammar's grammar grows with the square of the nesting (depth 400: ~18 s on the dev
    box, 1000: minutes on a compile thread): a bound refuses it at once."""
    schema: Any = {"type": "boolean"}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(GrammarError, match="nested deeper than"):
        compile_schema(backend, schema)
