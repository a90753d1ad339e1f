"""Output parsers, per family, fed the model's text split at every character boundary.

Each case is run whole, one character at a time, split once at every boundary, and split at
random places: the content and the assembled calls must be identical every time (a parser
that loses or duplicates text at a split shows up here).
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.parsers import ThinkParser, ToolParser, make_tool_parser
from gateway.parsers.base import marker_hold
from gateway.parsers.xml_tools import typed_value


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run_tools(make: Callable[[], ToolParser],
              pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    p = make()
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}

    def take(d: Any) -> None:
        content.append(d.content)
        for c in d.calls:
            if c.name is not None:  # a call's first delta: its name, before any argument text
                assert c.index not in calls and c.arguments == ""
                calls[c.index] = {"name": c.name, "arguments": ""}
            else:
                calls[c.index]["arguments"] += c.arguments

    for piece in pieces:
        take(p.feed(piece))
    take(p.finish())
    return "".join(content), [calls[i] for i in sorted(calls)]


def assert_every_split(make: Callable[[], ToolParser], text: str, content: str,
                       calls: list[tuple[str, Any]]) -> None:
    want = [{"name": n, "arguments": a} for n, a in calls]
    for pieces in splits(text):
        got_content, got_calls = run_tools(make, pieces)
        assert got_content == content, pieces
        parsed = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in got_calls]
        assert parsed == want, pieces


HERMES = ('Let me look that up.\n\n<tool_call>\n{"name": "lookup", "arguments": {"name": "q"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}"}]}}'
          '\n</tool_call>')
CASES: list[tuple[str, str, str, list[tuple[str, Any]]]] = [
    ("hermes", HERMES, "Let me look that up.\n\n",
     [("lookup", {"name": "q"}), ("add", {"a": 1, "b": [2, {"c": "}"}]})]),
    ("qwen3", '<tool_call>\n{"arguments": {"x": "é🙂"}, "name": "f"}\n</tool_call>', "",
     [("f", {"x": "é🙂"})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "",
     [("f", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "noargs"}\n</tool_call>', "", [("noargs", {})]),
    ("hermes", "no calls, but a <tool_ mention and a < sign", "no calls, but a <tool_ mention "
     "and a < sign", []),
    ("hermes", "<tool_call>\nnot json</tool_call> after", "<tool_call>\nnot json</tool_call> "
     "after", []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}', "",
     [("f", {"s": "a;b"})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    # A JSON object with no name is not a call (an answer in JSON, a response_format's): its
    # text is content. It crashed the gateway (a call delta for call -1), or after a call
    # appended "{}" to that call's arguments.
    ("llama3_json", '{"answer": 3, "why": "x"}', '{"answer": 3, "why": "x"}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"answer": 3}', '{"answer": 3}',
     [("f", {"a": 1})]),
    # Cut short before any name: with no marker, the JSON answer as far as it came (it was
    # dropped: a response_format's JSON cut by max_tokens came back as no content at all); a
    # cut after `<|python_tag|>` or after a call is a call cut before its name.
    ("llama3_json", '{"answer": "cut sh', '{"answer": "cut sh', []),
    ("llama3_json", '<|python_tag|>{"na', "", []),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"na', "", [("f", {})]),
    ("hermes", '<tool_call>\n{"foo": 1}\n</tool_call>', '<tool_call>\n{"foo": 1}\n</tool_call>',
     []),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
     '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{}\n'
     '</tool_call>', '\n<tool_call>\n{}\n</tool_call>', [("f", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"answer": 3}]', '{"answer": 3}',
     [("f", {})]),
    # Whitespace after the calls is dropped only while nothing else came since the last one:
    # text's own trailing newline stayed or went with how the text was split.
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone.\n',
     "\n\nDone.\n", [("f", {})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", '
     '"arguments": {}}]', "Sure. ", [("f", {"x": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": [1, 2]}[TOOL_CALLS]g[CALL_ID]a1b2c3d4e[ARGS]{}', "",
     [("f", {"x": [1, 2]}), ("g", {})]),
    ("deepseek_v3", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
     'get_weather\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
     'function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Checking.", [("get_weather", {"city": "Tokyo"}), ("g", {})]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": "b"}'
     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("f", {"a": "b"})]),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_tool_parser_every_split(parser: str, text: str, content: str,
                                 calls: list[tuple[str, Any]]) -> None:
    assert_every_split(functools.partial(make_tool_parser, parser, {}), text, content, calls)


QWEN_CODER_TOOLS = {"f": {"type": "object", "properties": {
    "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"},
    "b": {"type": "boolean"}, "x": {"type": "number"}}}}


def test_qwen3_coder_xml_typed_values_every_split() -> None:
    text = ("I will call it.\n<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n"
            "<parameter=s>\nline one\nline \"two\"\n</parameter>\n<parameter=o>\n{\"a\": [1]}\n"
            "</parameter>\n<parameter=b>\ntrue\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=g>\n</function>\n</tool_call>")
    want = [("f", {"n": 42, "s": 'line one\nline "two"', "o": {"a": [1]}, "b": True, "x": 2.5,
                   "extra": "7"}), ("g", {})]
    assert_every_split(functools.partial(make_tool_parser, "qwen3_coder", QWEN_CODER_TOOLS), text,
                       "I will call it.\n", want)


def test_qwen3_coder_stray_text_between_parameters_every_split() -> None:
    """Stray text between parameters is dropped, up to the next marker: it took the rest of
    its piece with it, so the whole text (the non-streaming path) lost `s` where a stream fed
    token by token kept it."""
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\nstray <parameter=s>\nx\n"
            "</parameter> more</function>\n</tool_call>")
    assert_every_split(functools.partial(make_tool_parser, "qwen3_coder", QWEN_CODER_TOOLS), text,
                       "", [("f", {"n": 1, "s": "x"})])


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_stray_text_inside_the_calls_block_every_split(parser: str) -> None:
    """As in qwen3_coder: stray text is dropped up to the next marker, not with the rest of
    its piece (the whole text lost the call after it, a stream kept it)."""
    call = ('<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
            '<｜tool▁call▁end｜>' if parser == "deepseek_v3" else
            '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>')
    text = f"<｜tool▁calls▁begin｜> junk {call}<｜tool▁calls▁end｜> after"
    assert_every_split(functools.partial(make_tool_parser, parser, {}), text, " after",
                       [("f", {"a": 1})])


def test_typed_value_falls_back_to_text() -> None:
    assert typed_value("12", {"type": "integer"}) == 12
    assert typed_value("twelve", {"type": "integer"}) == "twelve"
    assert typed_value("3", {"type": ["number", "null"]}) == 3
    assert typed_value("null", {"type": "integer"}) is None
    assert typed_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert typed_value("{bad", {"type": "object"}) == "{bad"
    assert typed_value(" x ", None) == " x "


def test_an_enum_value_is_the_member_without_the_formats_whitespace() -> None:
    """qwen3_coder's grammar lets one whitespace character around a value (forced calls wrote
    `<parameter=tz>utc\t</parameter>`): the member is the value, the rest is the format's."""
    zone = {"type": "string", "enum": ["utc", "cet"]}
    assert typed_value("utc\t", zone) == "utc" and typed_value("\rcet ", zone) == "cet"
    assert typed_value(" x", {"const": "x"}) == "x"
    assert typed_value(" x", {"enum": [" x", "x"]}) == " x"  # a member as written stays
    assert typed_value(" y ", zone) == " y "  # not a member either way: the text as it came
    assert typed_value(" utc ", {"type": "string"}) == " utc "  # free text is the value


def test_truncated_call_keeps_what_arrived() -> None:
    # max_tokens cut the call short: the name and the arguments so far are still a call.
    content, calls = run_tools(functools.partial(make_tool_parser, "hermes", {}),
                               ['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'])
    assert content == "" and calls == [{"name": "f", "arguments": '{"a": [1, 2'}]


def run_think(name: str, starts: bool, pieces: list[str]) -> tuple[str, str]:
    p = ThinkParser(name, starts)
    r, c = [], []
    for piece in pieces:
        a, b = p.feed(piece)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    return "".join(r + [a]), "".join(c + [b])


THINK_CASES = [
    ("qwen3", False, "<think>\nx = 1, so\n\nx + 1 = 2\n</think>\n\nThe answer is 2.",
     ("x = 1, so\n\nx + 1 = 2", "The answer is 2.")),
    ("qwen3", False, "The answer is 2 (no <think> here).",
     ("", "The answer is 2 (no <think> here).")),
    ("qwen3", False, "<think>\ncut short", ("cut short", "")),
    ("qwen3", False, "<thin", ("", "<thin")),
    ("qwen3", True, "already thinking\n</think>\n\nanswer", ("already thinking", "answer")),
    ("deepseek_r1", False, "no open tag\n</think>\n\nfour", ("no open tag", "four")),
    ("deepseek_r1", False, "<think>\nall reasoning", ("all reasoning", "")),
    ("qwen3", False, "<think>\n\n</think>\n\n", ("", "")),
]


@pytest.mark.parametrize("name,starts,text,want", THINK_CASES)
def test_reasoning_parser_every_split(name: str, starts: bool, text: str,
                                      want: tuple[str, str]) -> None:
    for pieces in splits(text):
        assert run_think(name, starts, pieces) == want, pieces


def test_marker_hold() -> None:
    assert marker_hold("abc<tool_", ("<tool_call>",)) == 6
    assert marker_hold("abc<tool_call", ("<tool_call>",)) == 10
    assert marker_hold("abc", ("<tool_call>",)) == 0
    assert marker_hold("<", ("<think>", "</think>")) == 1
