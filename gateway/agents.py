"""A chat request's agent inputs: template messages and tools, template kwargs, which
parsers read the output, and the output constraint.

`plan_chat(req, tok, parsers)` is the chat path's one entry: it validates what the template
and the parsers need (roles, tool_call_id, tool names, tool_choice against tools and the
configured parser, template kwargs against what the template reads), renders the prompt, and
returns a `ChatPlan`. The rules, each a 400 naming the field when broken:
- `tools` need a tool-call parser (`gateway.tool_call_parser`): calls nobody parses would
  reach the client as plain text, which is a silent drop;
- each tool's `parameters` must be a valid JSON schema (its draft's meta-schema);
- `tool_choice` "none" renders no tools (the model is not shown what it may not call) and
  parses none; "auto" renders and parses; "required" / a named function also force the call
  through a grammar in the parser's own format (see parsers/constraints.py); under "auto",
  `strict` tools hold every call the model starts to its tool's schema (the others' to a JSON
  object) through a grammar triggered by the format's call marker;
- `chat_template_kwargs` keys and `reasoning_effort` must be variables the template reads,
  and a message's `name` must reach the rendered prompt.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from gateway.errors import BadRequest
from gateway.openai_types import CLIENT_ECHOES, ChatCompletionRequest, ChatMessage
from gateway.parsers import ThinkParser, make_tool_parser, prompt_opens_reasoning
from gateway.parsers.constraints import auto_calls_format, reasoning_prefix, tool_calls_format
from gateway.parsers.reasoning import THINK_CLOSE, THINK_OPEN, prompt_closes_reasoning
from gateway.structured import Constraint, StrictCalls, request_constraint
from gateway.tokenizer import RESERVED_TEMPLATE_VARS, Tokenizer
from protocol import tandem_pb2

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a non-strict tool's arguments beside strict ones


@dataclass(frozen=True)
class Parsers:
    """The gateway's configured output parsers ("" = none), resolved at start-up."""

    reasoning: str = ""
    tool_call: str = ""


@dataclass(frozen=True)
class ChatPlan:
    """What serving one chat request needs beyond the sampling fields."""

    prompt_ids: list[int]
    tool_parser: str = ""  # "" = tool calls are not parsed for this request
    tool_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    reasoning_parser: str = ""
    starts_in_reasoning: bool = False  # the prompt opened the think block
    parallel_tool_calls: bool = True
    # tool_choice named one function: OpenAI ends such a turn with finish_reason "stop", not
    # "tool_calls" (the client asked for that call; vLLM matches it).
    named_tool_choice: bool = False
    structured: tandem_pb2.StructuredOutput | None = None
    constraint_source: str = ""  # the request field the constraint came from
    # Special tokens the parsers look for: kept when the output is detokenized.
    keep_token_ids: frozenset[int] = frozenset()

    def new_parsers(self) -> tuple[ThinkParser | None, Any]:
        """Fresh streaming parsers for this request (each holds per-request state)."""
        think = (ThinkParser(self.reasoning_parser, self.starts_in_reasoning)
                 if self.reasoning_parser else None)
        tools = make_tool_parser(self.tool_parser, self.tool_parameters) \
            if self.tool_parser else None
        return think, tools


def template_message(m: ChatMessage, i: int) -> dict[str, Any]:
    """One message as chat templates read it (the shape vLLM gives apply_chat_template)."""
    where = f"messages[{i}]"
    for name in ("refusal", "audio", "function_call", "annotations"):
        if getattr(m, name):
            raise BadRequest(f"{where}.{name} is not supported in a message; omit it",
                             param="messages")
    both = m.reasoning_content is not None and m.reasoning is not None
    if both and m.reasoning_content != m.reasoning:  # the same text under both names is fine
        raise BadRequest(f"{where}: reasoning_content and reasoning differ; send one (the "
                         "other would be dropped)", param="messages")
    if m.content is None and m.role != "assistant":  # OpenAI's rule: only an assistant turn
        raise BadRequest(f"{where}.content is required in a {m.role} message; send a string "
                         "(it may be empty)", param="messages")
    if m.role == "tool" and not m.tool_call_id:
        raise BadRequest(f"{where}: a tool message needs tool_call_id (the id of the call it "
                         "answers)", param="messages")
    if m.tool_calls and m.role != "assistant":
        raise BadRequest(f"{where}: only assistant messages carry tool_calls", param="messages")
    # Templates read these on their own roles only: elsewhere they would change nothing.
    if m.tool_call_id is not None and m.role != "tool":
        raise BadRequest(f"{where}: only tool messages carry tool_call_id", param="messages")
    if (m.reasoning_content is not None or m.reasoning is not None) and m.role != "assistant":
        raise BadRequest(f"{where}: only assistant messages carry reasoning_content (an "
                         "earlier answer's reasoning)", param="messages")
    # HF templates predate the developer role; OpenAI defines it as the system role.
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                         "content": m.text(where) or ""}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if m.tool_calls:
        d["tool_calls"] = [_history_call(tc.model_dump(exclude_none=True, exclude=CLIENT_ECHOES),
                                         f"{where}.tool_calls[{j}]")
                           for j, tc in enumerate(m.tool_calls)]
    return d


def _history_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    # Templates differ (Qwen's accepts a string or a mapping, Llama's runs `tojson` on it):
    # like vLLM, give them the mapping that transformers documents.
    args = call["function"].get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise BadRequest(f"{where}.function.arguments is not valid JSON text",
                             param="messages") from None
    call["function"]["arguments"] = args
    return call


def _template_kwargs(req: ChatCompletionRequest, tok: Tokenizer) -> dict[str, Any]:
    """Extra template variables; each must be one the template reads (else nothing changes)."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in ("messages", "tools", "add_generation_prompt"):
            raise BadRequest(f"chat_template_kwargs may not set {key!r}; send it as the "
                             "request field", param="chat_template_kwargs")
        if key in RESERVED_TEMPLATE_VARS:  # no request field sets it either (documents)
            raise BadRequest(f"chat_template_kwargs: {key!r} is not supported (the gateway "
                             "sets it); omit it", param="chat_template_kwargs")
        if key not in tok.template_vars:
            raise BadRequest(f"chat_template_kwargs: this model's chat template does not read "
                             f"{key!r}, so it would change nothing; omit it",
                             param="chat_template_kwargs")
    if req.reasoning_effort is not None:
        if "reasoning_effort" not in tok.template_vars:
            raise BadRequest("reasoning_effort: this model's chat template does not read it, "
                             "so it would change nothing; omit it", param="reasoning_effort")
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def _check_names(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 kwargs: dict[str, Any], tok: Tokenizer) -> None:
    """A message's `name` must reach the prompt: rendered once more with a marker for each
    name, a marker the template left out is a name it drops (Qwen's templates drop all)."""
    named = [i for i, m in enumerate(messages) if "name" in m]
    if not named:
        return
    marked = [dict(m, name=f"@@tandem-name-{i}@@") if i in named else m
              for i, m in enumerate(messages)]
    text = tok.render_chat(marked, tools=tools, kwargs=kwargs)
    for i in named:
        if f"@@tandem-name-{i}@@" not in text:
            role = messages[i]["role"]
            article = "an" if role == "assistant" else "a"  # "a user", "a tool", "an assistant"
            raise BadRequest(f"messages[{i}].name: this model's chat template does not use "
                             f"{article} {role} message's name, so it would change nothing; "
                             "omit it", param="messages")


def _render(req: ChatCompletionRequest, tok: Tokenizer, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
    """The prompt text. `continue_final_message` cuts it right after the last message's text,
    as transformers' apply_chat_template does (the template's end of turn after it goes; a
    template that trims the text's trailing whitespace is cut after what it kept)."""
    f = "continue_final_message"
    if req.continue_final_message and req.add_generation_prompt:
        raise BadRequest(f"{f} and add_generation_prompt cannot both be true (the message "
                         "would be closed and a new turn opened); send add_generation_prompt: "
                         "false", param=f)
    text = tok.render_chat(messages, add_generation_prompt=req.add_generation_prompt,
                           tools=tools, kwargs=kwargs)
    if not req.continue_final_message:
        return text
    final = messages[-1]["content"]
    at = text.rfind(final.strip()) if final.strip() else -1
    if at == -1:
        raise BadRequest(f"{f}: the last message has no text to continue (or the chat "
                         "template does not write it); send its text", param=f)
    kept = final.lstrip()
    return text[:at + (len(kept) if text[at:at + len(kept)] == kept else len(final.strip()))]


def _check_tools(req: ChatCompletionRequest, parsers: Parsers,
                 tok: Tokenizer) -> dict[str, dict[str, Any]]:
    """Tool name -> parameters schema; raises for what the request gets wrong."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools; send tools or omit tool_choice",
                             param="tool_choice")
        return {}
    params: dict[str, dict[str, Any]] = {}
    for t in tools:
        name = t.function.name
        if not _TOOL_NAME.match(name):
            raise BadRequest(f"tools: function name {name!r} must match ^[A-Za-z0-9_-]{{1,64}}$",
                             param="tools")
        if name in params:
            raise BadRequest(f"tools: function {name!r} is listed twice", param="tools")
        params[name] = t.function.parameters or {"type": "object", "properties": {}}
        _check_schema(name, params[name])
    if choice == "none":
        return params
    if "tools" not in tok.template_vars:
        raise BadRequest("tools: this model's chat template does not render tools, so the "
                         "model would never see them; send tool_choice \"none\" or serve a "
                         "model whose template reads `tools`", param="tools")
    if not parsers.tool_call:
        raise BadRequest("tools need a tool-call parser and this gateway has none; start it "
                         "with --tool-call-parser (gateway.tool_call_parser), or send "
                         "tool_choice \"none\"", param="tools")
    named = req.named_tool()
    if named is not None and named not in params:
        raise BadRequest(f"tool_choice names {named!r}, which is not in tools",
                         param="tool_choice")
    return params


def _check_schema(name: str, schema: dict[str, Any]) -> None:
    """400 unless `schema` is valid under its draft's meta-schema (2020-12 without `$schema`)."""
    problem = _schema_problem(json.dumps(schema, sort_keys=True))
    if problem is not None:
        raise BadRequest(f"tools: the parameters of function {name!r} are not a valid JSON "
                         f"schema: {problem}", param="tools")


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> str | None:
    """What the meta-schema says is wrong with a schema (as JSON text), or None. Cached by the
    text: a check costs ~0.4 ms, and an agent sends the same tools with every turn."""
    schema = json.loads(text)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "its top level"
        return f"{exc.message} (at {where})"
    return None


def _call_format(parsers: Parsers, tok: Tokenizer) -> str:
    fmt = parsers.tool_call
    if fmt == "mistral" and tok.token_id("[ARGS]") is not None:
        fmt = "mistral_v11"
    return fmt


def _forced_calls(req: ChatCompletionRequest, parsers: Parsers, tok: Tokenizer,
                  params: dict[str, dict[str, Any]]) -> Constraint | None:
    if req.tool_choice in (None, "none", "auto") or not params:
        return None
    named = req.named_tool()
    if named is None:  # "required": any of the tools
        tools = list(params.items())
        parallel = req.parallel_tool_calls
    else:
        tools = [(named, params[named])]
        parallel = False  # a named function is called once
    return Constraint("tool_choice", "structural_tag", format=tool_calls_format(
        _call_format(parsers, tok), tools, parallel, tok.special_token_texts))


def _strict_calls(req: ChatCompletionRequest, parsers: Parsers, tok: Tokenizer,
                  params: dict[str, dict[str, Any]]) -> StrictCalls | None:
    """Under tool_choice "auto": the grammars that hold calls to schemas (a non-strict tool's
    to a JSON object), used alone when a tool is `strict`, else only beside a constraint."""
    if req.tool_choice not in (None, "auto") or not params:
        return None
    strict = {t.function.name for t in req.tools or [] if t.function.strict}
    fmt = _call_format(parsers, tok)
    tools = [(name, schema if name in strict else _ANY_OBJECT) for name, schema in params.items()]
    special = tok.special_token_texts
    return StrictCalls(auto_calls_format(fmt, tools, req.parallel_tool_calls, special),
                       tool_calls_format(fmt, tools, req.parallel_tool_calls, special),
                       alone=bool(strict))


def plan_chat(req: ChatCompletionRequest, tok: Tokenizer, parsers: Parsers) -> ChatPlan:
    """Validate the agent fields, render the prompt, and say how to read the output."""
    if not req.messages:
        raise BadRequest("messages must hold at least one message", param="messages")
    messages = [template_message(m, i) for i, m in enumerate(req.messages)]
    params = _check_tools(req, parsers, tok)
    parse_tools = bool(params) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []] \
        if parse_tools else None
    kwargs = _template_kwargs(req, tok)
    text = _render(req, tok, messages, tools, kwargs)
    _check_names(messages, tools, kwargs, tok)
    starts = bool(parsers.reasoning) and prompt_opens_reasoning(text)
    constraint = request_constraint(req, _forced_calls(req, parsers, tok, params),
                                    _strict_calls(req, parsers, tok, params))
    structured = None
    if constraint is not None:
        prefix = reasoning_prefix(parsers.reasoning, starts, tok.special_token_texts,
                                  closed_in_prompt=prompt_closes_reasoning(text))
        structured = constraint.to_proto(prefix)
    tool_parser = parsers.tool_call if parse_tools else ""
    markers: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE) if parsers.reasoning else ()
    if tool_parser:
        markers += make_tool_parser(tool_parser, {}).markers
    keep = frozenset(i for i in (tok.token_id(m) for m in markers) if i is not None)
    return ChatPlan(prompt_ids=tok.encode(text, add_special_tokens=False),
                    tool_parser=tool_parser, tool_parameters=params if parse_tools else {},
                    reasoning_parser=parsers.reasoning, starts_in_reasoning=starts,
                    parallel_tool_calls=req.parallel_tool_calls,
                    named_tool_choice=parse_tools and req.named_tool() is not None,
                    structured=structured,
                    constraint_source=constraint.source if constraint is not None else "",
                    keep_token_ids=keep)
