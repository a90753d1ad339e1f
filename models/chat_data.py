"""Training examples for models/tandem-arith: arith and lookup problems in every prompt format.

Each example is one prompt and the completion the model must write after it; the loss covers
the completion only (the assignments are random: nothing to learn there). Chat prompts are
rendered by the chat template itself (models/chat_template.jinja, in a sandboxed jinja2
environment like the gateway's), so the model trains on exactly what a server sends it.

Formats (`Format`), each a share of the training mix (`MIX`):
    raw            arith prompt as /v1/completions text            -> "k=41,m=12;<eos>"
    chat           arith as one user message (+ a system one now and then; tools now and then)
    chat_think     the same with enable_thinking: the model writes <think>..</think> first
    calls          lookup: tools + question -> one <tool_call> per missing variable, then eos
    calls_think    the same, thinking first ("q=?;" for what it must look up)
    answer         lookup, after the tool results -> "k=41,q=42;<eos>"
    answer_think   the same, thinking first (the values it now has)

The tool definition varies as clients vary it: the description (or none), and the JSON key
order (jinja2's `tojson` sorts keys, transformers' keeps the client's order).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from orchestrator.tasks import arith, lookup  # noqa: E402

EOS = "<|endoftext|>"
TEMPLATE_PATH = Path(__file__).resolve().parent / "chat_template.jinja"
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer with the values.",
    "Be brief.",
)
TOOL_DESCRIPTIONS = (
    lookup.LOOKUP_TOOL["function"]["description"],
    "Returns the value of the named variable.",
    "Variable lookup.",
    "",  # no description at all
)


class Format(Enum):
    RAW = "raw"
    CHAT = "chat"
    CHAT_THINK = "chat_think"
    CALLS = "calls"
    CALLS_THINK = "calls_think"
    ANSWER = "answer"
    ANSWER_THINK = "answer_think"


# Shares of the training mix. Raw and chat arith keep most of it: the arith gate comes first.
MIX: dict[Format, float] = {
    Format.RAW: 0.26,
    Format.CHAT: 0.22,
    Format.CHAT_THINK: 0.08,
    Format.CALLS: 0.16,
    Format.CALLS_THINK: 0.06,
    Format.ANSWER: 0.16,
    Format.ANSWER_THINK: 0.06,
}
# The first phase (train_arith.py --arith-first): the look-up of the first and the last
# assignment, which every format needs, learnt on short sequences before the rest joins.
ARITH_MIX: dict[Format, float] = {Format.RAW: 0.5, Format.CHAT: 0.5}
THINKING = {Format.CHAT_THINK, Format.CALLS_THINK, Format.ANSWER_THINK}


@dataclass(frozen=True)
class Sample:
    fmt: Format
    prompt: str  # the text the model is given (template-rendered for the chat formats)
    completion: str  # what it must write, ending with eos


def _tojson_keep_order(value: Any) -> str:
    # transformers' tojson: the client's key order, no HTML escaping.
    return json.dumps(value, ensure_ascii=False)


def make_environments() -> tuple[jinja2.Template, jinja2.Template]:
    """The template as the gateway compiles it, and with transformers' key-order `tojson`."""
    source = TEMPLATE_PATH.read_text()
    out = []
    for keep_order in (False, True):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        if keep_order:
            env.filters["tojson"] = _tojson_keep_order
        out.append(env.from_string(source))
    return out[0], out[1]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def think_block(pairs: list[tuple[str, str]]) -> str:
    """What the model reasons: the assignments it needs, "?" for a value it must look up."""
    return "<think>\n" + "".join(f"{n}={v};" for n, v in pairs) + "\n</think>\n\n"


def tool_call_text(name: str) -> str:
    """One hermes-style call, exactly as the template renders it back in the history."""
    args = json.dumps({"name": name})
    return f'<tool_call>\n{{"name": "{lookup.TOOL_NAME}", "arguments": {args}}}\n</tool_call>'


def random_tool(rng: random.Random) -> dict[str, Any]:
    fn = dict(lookup.LOOKUP_TOOL["function"])
    description = rng.choice(TOOL_DESCRIPTIONS)
    if description:
        fn["description"] = description
    else:
        del fn["description"]
    return {"type": "function", "function": fn}


class SampleMaker:
    """Draws samples of each format; `rng` decides everything, so a seed fixes the stream."""

    def __init__(self, min_assignments: int) -> None:
        self.min_assignments = min_assignments
        self.sorted_keys, self.kept_keys = make_environments()

    def render(self, rng: random.Random, messages: list[dict[str, Any]], **kw: Any) -> str:
        template = rng.choice((self.sorted_keys, self.kept_keys))
        return template.render(messages=messages, add_generation_prompt=True, **kw)

    def draw(
        self, rng: random.Random, fmt: Format | None = None, mix: dict[Format, float] = MIX
    ) -> Sample:
        """One sample of `fmt`, or of a format drawn with the weights of `mix`."""
        if fmt is None:
            fmt = rng.choices(list(mix), weights=list(mix.values()))[0]
        think = fmt in THINKING
        if fmt in (Format.RAW, Format.CHAT, Format.CHAT_THINK):
            return self._arith(rng, fmt, think)
        return self._lookup(rng, fmt, think)

    def _head(self, rng: random.Random, p_system: float) -> list[dict[str, Any]]:
        if rng.random() < p_system:
            return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        return []

    def _arith(self, rng: random.Random, fmt: Format, think: bool) -> Sample:
        problem = arith.make_problem(
            rng, rng.randint(self.min_assignments, arith.MAX_ASSIGNMENTS)
        )
        answer = problem.answer + arith.STOP + EOS
        if fmt is Format.RAW:
            return Sample(fmt, problem.prompt, answer)
        messages = [*self._head(rng, 0.15), {"role": "user", "content": problem.prompt}]
        # With the tool on offer and every asked value in the prompt, it answers directly.
        kw: dict[str, Any] = {"tools": [random_tool(rng)]} if rng.random() < 0.3 else {}
        if think:
            pairs = [tuple(a.split("=")) for a in problem.answer.split(",")]
            answer = think_block(pairs) + answer  # type: ignore[arg-type]
            kw["enable_thinking"] = True
        elif rng.random() < 0.5:
            kw["enable_thinking"] = False  # the default, said out loud
        return Sample(fmt, self.render(rng, messages, **kw), answer)

    def _lookup(self, rng: random.Random, fmt: Format, think: bool) -> Sample:
        problem = lookup.make_problem(
            rng, num_assignments=rng.randint(self.min_assignments, lookup.MAX_ASSIGNMENTS)
        )
        messages = [*self._head(rng, 0.1), {"role": "user", "content": problem.prompt}]
        kw: dict[str, Any] = {"tools": [random_tool(rng)]}
        if think:
            kw["enable_thinking"] = True
        if fmt in (Format.CALLS, Format.CALLS_THINK):
            pairs = [*problem.known, *((n, "?") for n, _ in problem.missing)]
            calls = "\n".join(tool_call_text(n) for n, _ in problem.missing)
            head = think_block(pairs) if think else ""
            return Sample(fmt, self.render(rng, messages, **kw), head + calls + EOS)
        messages.append(assistant_calls(rng, [n for n, _ in problem.missing]))
        for i, (_, value) in enumerate(problem.missing):
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": value})
        head = think_block([*problem.known, *problem.missing]) if think else ""
        completion = head + problem.answer + lookup.STOP + EOS
        return Sample(fmt, self.render(rng, messages, **kw), completion)


def assistant_calls(rng: random.Random, names: list[str]) -> dict[str, Any]:
    """The assistant message a client sends back: its tool calls, content empty or absent."""
    calls = []
    for i, name in enumerate(names):
        # Clients send arguments as the JSON text they got; a few send the object itself.
        args: Any = json.dumps({"name": name}) if rng.random() < 0.8 else {"name": name}
        calls.append(
            {"id": f"call_{i}", "type": "function",
             "function": {"name": lookup.TOOL_NAME, "arguments": args}}
        )
    message: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    if rng.random() < 0.5:
        message["content"] = ""
    return message
