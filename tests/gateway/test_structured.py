"""The output constraints the gateway puts on the wire, compiled and run with xgrammar the way
a worker does (GrammarCompiler over the model's vocabulary, a matcher fed token ids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from gateway.agents import Parsers, plan_chat
from gateway.errors import BadRequest
from gateway.openai_types import ChatCompletionRequest, CompletionRequest
from gateway.request_body import parse_request
from gateway.structured import request_constraint
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2
from worker.grammar_xgr import GrammarBackend, tokenizer_info
from worker.sampling import StructuredOutput

transformers = pytest.importorskip("transformers")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]+$"}, "tags": {"type": "array", "items": {
        "enum": ["x", "y"]}}, "inner": {"type": "object", "properties": {"n": {"type": "integer"}},
                                        "required": ["n"]}},
    "required": ["name", "tags", "inner"], "additionalProperties": False}
GOOD = '{"name": "abc", "tags": ["x"], "inner": {"n": 3}}'
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}


class Worker:
    """What a worker does with `StructuredOutput`: the worker's own grammar backend compiles it
    over the vocabulary (worker/grammar_xgr.py), then token ids are checked against a matcher."""

    def __init__(self, tok_dir: Path) -> None:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
        self.hf = hf
        self.eos = hf.convert_tokens_to_ids("<|im_end|>")
        text = (tok_dir / "tokenizer.json").read_text()
        self.backend = GrammarBackend(tokenizer_info(text, len(hf), [self.eos]))

    def compile(self, so: tandem_pb2.StructuredOutput) -> Any:
        return self.backend.compile(StructuredOutput.from_proto(so))

    def accepts(self, so: tandem_pb2.StructuredOutput, text: str) -> bool:
        matcher = xgr.GrammarMatcher(self.compile(so))
        ids = self.hf.encode(text, add_special_tokens=False)
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(self.eos)


@pytest.fixture(scope="module")
def worker(hermes_dir: Path) -> Worker:
    return Worker(hermes_dir)


def completion(**kw: Any) -> CompletionRequest:
    return parse_request(json.dumps({"prompt": "x", **kw}).encode(), CompletionRequest)


def chat(**kw: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "q?"}], **kw}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


SOURCES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA,
                                                                 "strict": True}}}, GOOD,
     '{"name": "ABC", "tags": [], "inner": {"n": 3}}'),
    ({"response_format": {"type": "json_object"}}, '{"any": [1, 2]}', "[1, 2]"),
    ({"guided_json": SCHEMA}, GOOD, '{"name": "abc"}'),
    ({"guided_json": json.dumps(SCHEMA)}, GOOD, "{}"),
    ({"guided_regex": "[0-9]{3}-[a-z]+"}, "123-abc", "12-abc"),
    ({"guided_choice": ["yes", "no"]}, "no", "maybe"),
    ({"guided_grammar": 'root ::= "a" ("b" | "c")*'}, "abcb", "abd"),
    ({"structured_outputs": {"json": SCHEMA}}, GOOD, '{"tags": ["z"]}'),
    ({"structured_outputs": {"choice": ["left", "right"]}}, "right", "up"),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</a>"}})}}, f"<a>{GOOD}</a>", GOOD),
    ({"response_format": {"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}},
     f"text <f>{GOOD}</f> more", "text <f>{}</f>"),
]


@pytest.mark.parametrize("kw,good,bad", SOURCES, ids=[next(iter(s[0])) + str(i)
                                                      for i, s in enumerate(SOURCES)])
def test_constraint_compiles_and_matches(worker: Worker, kw: dict[str, Any], good: str,
                                         bad: str) -> None:
    c = request_constraint(completion(**kw))
    assert c is not None
    so = c.to_proto([])
    assert worker.accepts(so, good) and not worker.accepts(so, bad)


def test_reasoning_block_comes_before_the_constraint(worker: Worker, hermes_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(guided_json=SCHEMA), tok, Parsers(reasoning="qwen3"))
    assert plan.structured is not None and plan.structured.WhichOneof("kind") == "structural_tag"
    assert worker.accepts(plan.structured, f"<think>\nfirst a, then b\n</think>\n\n{GOOD}")
    assert worker.accepts(plan.structured, GOOD)  # no block: straight to the answer
    assert not worker.accepts(plan.structured, "<think>\nhm\n</think>\n\nplain text")
    # The whitespace between the block and the answer is bounded: no loop on newlines there.
    assert not worker.accepts(plan.structured, f"<think>\nhm\n</think>{' ' * 9}{GOOD}")


def test_no_think_block_once_the_prompt_closed_it(worker: Worker, hermes_dir: Path) -> None:
    """Thinking off: the template writes an empty `<think></think>` into the prompt, so the
    answer starts at once. A grammar that let a second block through gave
    `content: ""` and `reasoning_content: "4747"` to a json_object request."""
    tok = Tokenizer.from_dir(hermes_dir)
    for kw in ({"guided_json": SCHEMA}, {"tools": [LOOKUP], "tool_choice": "required"}):
        plan = plan_chat(chat(chat_template_kwargs={"enable_thinking": False}, **kw), tok,
                         Parsers(reasoning="qwen3", tool_call="hermes"))
        assert plan.structured is not None
        good = GOOD if "guided_json" in kw else hermes_call("lookup", {"name": "q"})
        assert worker.accepts(plan.structured, good)
        assert not worker.accepts(plan.structured, f"<think>\nhm\n</think>\n\n{good}")


@pytest.mark.parametrize("choice,parallel,good,bad", [
    ("required", True, ['lookup', {"name": "q"}], "The answer is 3."),
    ({"type": "function", "function": {"name": "lookup"}}, True, ['lookup', {"name": "q"}],
     '<tool_call>\n{"name": "lookup", "arguments": {"nom": "q"}}\n</tool_call>'),
])
def test_forced_tool_call_in_hermes_format(worker: Worker, hermes_dir: Path, choice: Any,
                                           parallel: bool, good: list[Any], bad: str) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(tools=[LOOKUP], tool_choice=choice, parallel_tool_calls=parallel), tok,
                     Parsers(reasoning="qwen3", tool_call="hermes"))
    assert plan.structured is not None
    body = json.dumps({"name": good[0], "arguments": good[1]})
    call = f"<tool_call>\n{body}\n</tool_call>"
    assert worker.accepts(plan.structured, call)
    assert worker.accepts(plan.structured, "<think>\nneed q\n</think>\n\n" + call)
    assert not worker.accepts(plan.structured, bad)
    two = call + "\n" + call
    assert worker.accepts(plan.structured, two) == (choice == "required")


def test_parallel_false_allows_one_call(worker: Worker, hermes_dir: Path) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(tools=[LOOKUP], tool_choice="required", parallel_tool_calls=False),
                     tok, Parsers(tool_call="hermes"))
    assert plan.structured is not None
    call = '<tool_call>\n{"name": "lookup", "arguments": {"name": "q"}}\n</tool_call>'
    assert worker.accepts(plan.structured, call)
    assert not worker.accepts(plan.structured, call + "\n" + call)


def test_mistral_markers_are_special_tokens(worker: Worker, hermes_dir: Path) -> None:
    """`[TOOL_CALLS]` / `[ARGS]` are special tokens here: the grammar names them as tokens,
    so the model emits the one token, not the marker spelled out."""
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(tools=[LOOKUP], tool_choice="required"), tok,
                     Parsers(tool_call="mistral"))
    assert plan.structured is not None
    assert '{"type": "token", "token": "[TOOL_CALLS]"}' in plan.structured.structural_tag
    ids = worker.hf.encode('[TOOL_CALLS]lookup[ARGS]{"name": "q"}', add_special_tokens=False)
    assert ids[0] == worker.hf.convert_tokens_to_ids("[TOOL_CALLS]")
    matcher = xgr.GrammarMatcher(worker.compile(plan.structured))
    assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(worker.eos)


@pytest.mark.parametrize("parser,call", [
    ("qwen3_coder", "<tool_call>\n<function=lookup>\n<parameter=name>\nq\n</parameter>\n"
                    "</function>\n</tool_call>"),
    ("llama3_json", '{"name": "lookup", "parameters": {"name": "q"}}'),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>lookup\n'
                    '```json\n{"name": "q"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>'
                     '{"name": "q"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
])
def test_forced_call_in_each_format(worker: Worker, hermes_dir: Path, parser: str,
                                    call: str) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(tools=[LOOKUP], tool_choice="required"), tok, Parsers(tool_call=parser))
    assert plan.structured is not None
    assert worker.accepts(plan.structured, call) and not worker.accepts(plan.structured, "hi")


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_json": {"type": "number", "maximum": float("inf")}}, "guided_json"),
    # a field of another type of response_format would be dropped: a schema never enforced
    ({"response_format": {"type": "json_object", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA},
                          "format": {"type": "any_text"}}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"},
                          "structures": [], "triggers": ["<f"]}}, "response_format"),
])
def test_bad_constraints_are_400s(kw: dict[str, Any], param: str) -> None:
    body = json.dumps({"prompt": "x", **kw}).encode()
    with pytest.raises(BadRequest) as info:
        c = request_constraint(parse_request(body, CompletionRequest))
        assert c is not None
        c.to_proto([])
    assert info.value.param == param, info.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "lookup"}}])
def test_forced_calls_beside_a_response_format_are_the_output(worker: Worker, hermes_dir: Path,
                                                              choice: Any) -> None:
    """OpenAI's reading (and vLLM's since its #32006): a forced turn is calls, and
    response_format shapes a text answer, which that turn has none of; an agent framework
    sends both (an output type, and tool_choice "required" until it resets it). It was a 400."""
    plan = plan_chat(chat(tools=[LOOKUP], tool_choice=choice,
                          response_format={"type": "json_object"}),
                     Tokenizer.from_dir(hermes_dir), Parsers(tool_call="hermes"))
    assert plan.structured is not None and plan.constraint_source == "tool_choice"
    assert worker.accepts(plan.structured, hermes_call("lookup", {"name": "q"}))
    assert not worker.accepts(plan.structured, '{"answer": 3}')


def test_forced_calls_and_a_whole_output_constraint_conflict(hermes_dir: Path) -> None:
    """guided_json (vLLM's) holds the whole output, which a forced call cannot be."""
    with pytest.raises(BadRequest) as info:
        plan_chat(chat(tools=[LOOKUP], tool_choice="required", guided_json={"type": "object"}),
                  Tokenizer.from_dir(hermes_dir), Parsers(tool_call="hermes"))
    assert "only one output constraint" in info.value.message


STRICT = {"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
    "type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]$"}},
    "required": ["name"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}


def hermes_call(name: str, args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("parallel", [True, False])
def test_strict_tools_under_auto_hold_every_call_to_its_schema(worker: Worker, hermes_dir: Path,
                                                               parallel: bool) -> None:
    tok = Tokenizer.from_dir(hermes_dir)
    plan = plan_chat(chat(tools=[STRICT, NOTE], parallel_tool_calls=parallel), tok,
                     Parsers(reasoning="qwen3", tool_call="hermes"))
    assert plan.structured is not None and plan.constraint_source == "tools"
    good = hermes_call("lookup", {"name": "q"})
    assert worker.accepts(plan.structured, "The answer is 3.")  # text stays free
    assert worker.accepts(plan.structured, "I need q.\n" + good)
    assert worker.accepts(plan.structured, "<think>\nneed q\n</think>\n\n" + good)
    assert worker.accepts(plan.structured, hermes_call("note", {"text": "any"}))
    assert not worker.accepts(plan.structured, hermes_call("lookup", {"name": "qq"}))
    assert not worker.accepts(plan.structured, hermes_call("lookup", {"nom": "q"}))
    assert not worker.accepts(plan.structured, hermes_call("note", ["not", "an", "object"]))
    assert not worker.accepts(plan.structured, hermes_call("other", {}))
    assert worker.accepts(plan.structured, good + "\n" + good) == parallel
    # without `strict`, "auto" constrains nothing
    loose = plan_chat(chat(tools=[LOOKUP]), tok, Parsers(tool_call="hermes"))
    assert loose.structured is None


def test_strict_tools_under_auto_trigger_on_a_special_token_marker(worker: Worker,
                                                                   hermes_dir: Path) -> None:
    plan = plan_chat(chat(tools=[STRICT]), Tokenizer.from_dir(hermes_dir),
                     Parsers(tool_call="mistral"))
    assert plan.structured is not None
    assert '"token_triggered_tags"' in plan.structured.structural_tag
    for text, ok in (('ok [TOOL_CALLS]lookup[ARGS]{"name": "q"}', True),
                     ('[TOOL_CALLS]lookup[ARGS]{"name": 3}', False), ("plain", True)):
        ids = worker.hf.encode(text, add_special_tokens=False)
        matcher = xgr.GrammarMatcher(worker.compile(plan.structured))
        assert (all(matcher.accept_token(t) for t in ids)
                and matcher.accept_token(worker.eos)) == ok, text


def test_strict_tools_beside_a_response_format_give_calls_or_the_answer(
        worker: Worker, hermes_dir: Path) -> None:
    plan = plan_chat(chat(tools=[STRICT], response_format={"type": "json_object"}),
                     Tokenizer.from_dir(hermes_dir), Parsers(tool_call="hermes"))
    assert plan.structured is not None and plan.constraint_source == "response_format"
    assert worker.accepts(plan.structured, hermes_call("lookup", {"name": "q"}))
    assert worker.accepts(plan.structured, '{"answer": 3}')
    assert not worker.accepts(plan.structured, "The answer is 3.")
    assert not worker.accepts(plan.structured, hermes_call("lookup", {"name": 3}))


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}},
])
def test_tools_beside_a_response_format_stay_callable(worker: Worker, hermes_dir: Path,
                                                      response_format: dict[str, Any]) -> None:
    """Under "auto" the answer is formatted and the tools may still be called (OpenAI's, and
    what an agent framework sends with an output type): the grammar held a non-strict tool's
    call out, so the model could only write the JSON answer (it was the answer alone)."""
    plan = plan_chat(chat(tools=[LOOKUP], response_format=response_format),
                     Tokenizer.from_dir(hermes_dir), Parsers(tool_call="hermes"))
    assert plan.structured is not None and plan.constraint_source == "response_format"
    assert worker.accepts(plan.structured, hermes_call("lookup", {"name": "q"}))
    assert worker.accepts(plan.structured, hermes_call("lookup", {"name": 3}))  # not strict
    assert worker.accepts(plan.structured, '{"answer": 3}')
    assert not worker.accepts(plan.structured, "The answer is 3.")
    assert not worker.accepts(plan.structured, hermes_call("other", {}))


def test_strict_tools_under_auto_trigger_before_the_name_in_llama3_json(
        worker: Worker, hermes_dir: Path) -> None:
    plan = plan_chat(chat(tools=[STRICT, NOTE], parallel_tool_calls=False),
                     Tokenizer.from_dir(hermes_dir), Parsers(tool_call="llama3_json"))
    assert plan.structured is not None

    def call(name: str, args: Any) -> str:
        return json.dumps({"name": name, "parameters": args})

    assert worker.accepts(plan.structured, "The answer is 3.")
    assert worker.accepts(plan.structured, call("lookup", {"name": "q"}))
    assert worker.accepts(plan.structured, call("note", {"text": "x"}))
    assert not worker.accepts(plan.structured, call("lookup", {"name": "qq"}))
    assert not worker.accepts(plan.structured, call("other", {}))
    assert not worker.accepts(plan.structured, call("lookup", {"name": "q"}) + "; "
                              + call("lookup", {"name": "b"}))  # parallel_tool_calls false


@pytest.mark.parametrize("kw,match", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "parameters of function 'f' are not a valid JSON schema: .* \\(at properties/a/type\\)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": [1, 2]}}}], "tool_choice": "none"},
     "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "banana"}}}]}, "not a valid JSON schema"),
])
def test_tools_the_gateway_cannot_honour_are_400s(hermes_dir: Path, kw: dict[str, Any],
                                                  match: str) -> None:
    with pytest.raises(BadRequest, match=match) as info:
        plan_chat(chat(**kw), Tokenizer.from_dir(hermes_dir), Parsers(tool_call="llama3_json"))
    assert info.value.param == "tools"


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
    {"response_format": {"type": "json_object"}},
    {"tools": [LOOKUP], "tool_choice": "required"},
    {"tools": [STRICT]},
], ids=["json_schema", "json_object", "forced_call", "strict_auto"])
def test_json_under_a_reasoning_parser_allows_no_run_of_whitespace(
        worker: Worker, hermes_dir: Path, kw: dict[str, Any]) -> None:
    """The shipped configs name a reasoning parser, so every JSON constraint travels inside a
    structural tag; its JSON must stay near-compact as on the plain path (a weak model loops on
    free whitespace: the embedded model wrote `{"answer"\\n:     \\n6` and ran out of tokens)."""
    plan = plan_chat(chat(**kw), Tokenizer.from_dir(hermes_dir),
                     Parsers(reasoning="qwen3", tool_call="hermes"))
    assert plan.structured is not None
    if "tools" in kw:
        good = hermes_call("lookup", {"name": "q"})
        loose = good.replace('{"name": "q"}', '{"name":    "q"}')
    else:
        good, loose = GOOD, GOOD.replace('"tags": ', '"tags"  :\n\n  ')
    if kw.get("response_format", {}).get("type") == "json_object":
        good = '{"text": "a    b"}'  # spaces inside a string stay free
    assert worker.accepts(plan.structured, good)
    assert not worker.accepts(plan.structured, loose)


@pytest.mark.parametrize("choice", ["required", None], ids=["forced", "strict_auto"])
def test_qwen3_coder_calls_allow_no_run_of_whitespace(worker: Worker, hermes_dir: Path,
                                                       choice: str | None) -> None:
    """The XML style as well: a random-weights model under a forced qwen3_coder call wrote runs
    of whitespace between and around the parameters until max_tokens, every time, and the
    parsed enum value kept them (`"cet\n\n\t\r..."`). A string value's own text stays free."""
    plan = plan_chat(chat(tools=[STRICT, NOTE], tool_choice=choice),
                     Tokenizer.from_dir(hermes_dir), Parsers(tool_call="qwen3_coder"))
    assert plan.structured is not None

    def call(name: str, key: str, value: str, between: str = "\n") -> str:
        return (f"<tool_call>\n<function={name}>\n<parameter={key}>{value}</parameter>"
                f"{between}</function>\n</tool_call>")

    assert worker.accepts(plan.structured, call("lookup", "name", "\nq\n"))
    assert not worker.accepts(plan.structured, call("lookup", "name", "\nq\n\n\t \n"))
    assert not worker.accepts(plan.structured, call("lookup", "name", "\nq\n", "\n\n\t  \n"))
    assert worker.accepts(plan.structured, call("note", "text", "\na    b\n\n\nc\n"))
