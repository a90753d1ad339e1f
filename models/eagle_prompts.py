"""Prompts for distilling a drafter head (models/train_eagle.py): the formats the target serves.

A head learns what the target writes after a prompt, so its prompts should look like what a
server sends the target. The embedded model (models/tandem-arith) answers arith prompts raw
and through its chat template (whose default generation prompt ends with an empty think block),
reasons first in `<think>..</think>` when `enable_thinking` is set, calls its one tool,
`lookup`, for each asked variable the prompt does not assign, and answers from the tool
results. Every format below is rendered by the target's own chat template (transformers'
`apply_chat_template`), so a changed template is followed; the target then continues each
prompt greedily (train_eagle.py) and the head is trained on those continuations.

    raw            arith prompt as /v1/completions text
    chat           arith as one user message (the tool on offer now and then)
    chat_think     the same with enable_thinking
    calls          tools + a question naming unassigned variables: the target's tool calls
    calls_think    the same, thinking first
    answer         the calls' results sent back as tool messages: the target's final answer
    answer_think   the same, thinking first

The formats and their shares (`Format`, `MIX`) are the target's own training mix, imported
from models/chat_data.py. That module draws the target's training samples (prompt and
completion, through its own jinja sandbox); this one needs only prompts, written to the
served template's shape before chat_data.py reached this branch, and it is what trained the
shipped eagle/ and mtp/ heads.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from models.chat_data import MIX, THINKING, Format  # noqa: E402
from orchestrator.tasks import arith  # noqa: E402

MAX_BARE_NAMES = 3  # a bare lookup question asks 1-3 variables, none assigned


def lookup_tool() -> dict[str, Any]:
    """The embedded model's one tool, as a client sends it in `tools` (a fresh dict)."""
    return {"type": "function", "function": {
        "name": "lookup", "description": "Look up the value of a variable.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                       "required": ["name"]}}}


def _lookup_question(rng: random.Random) -> tuple[str, list[str]]:
    """A lookup user message and the variables it asks that no assignment names: bare ("q,b?")
    or mixed (assignments, then "first,missing?"), half each."""
    if rng.random() < 0.5:
        names = rng.sample(arith.NAMES, rng.randint(1, MAX_BARE_NAMES))
        return ",".join(names) + "?", names
    names = rng.sample(arith.NAMES, rng.randint(4, arith.MAX_ASSIGNMENTS - 1) + 1)
    body = "".join(f"{n}={rng.randrange(100):02d};" for n in names[:-1])
    return f"{body}\n{names[0]},{names[-1]}?", names[-1:]


def _tool_turns(rng: random.Random, missing: list[str]) -> list[dict[str, Any]]:
    """The assistant's calls as a client sends them back, then one tool message per call."""
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "lookup", "arguments": json.dumps({"name": name})}}
             for i, name in enumerate(missing)]
    turns: list[dict[str, Any]] = [{"role": "assistant", "content": "", "tool_calls": calls}]
    turns += [{"role": "tool", "tool_call_id": f"call_{i}",
               "content": f"{rng.randrange(100):02d}"} for i in range(len(missing))]
    return turns


def render(tok: Any, rng: random.Random, fmt: Format) -> str:
    """One prompt of `fmt` as the text a server gives the target."""
    if fmt is Format.RAW:
        return arith.make_problem(rng, rng.randint(4, arith.MAX_ASSIGNMENTS)).prompt
    kw: dict[str, Any] = {"enable_thinking": fmt in THINKING}
    if fmt in (Format.CHAT, Format.CHAT_THINK):
        problem = arith.make_problem(rng, rng.randint(4, arith.MAX_ASSIGNMENTS))
        messages = [{"role": "user", "content": problem.prompt}]
        if rng.random() < 0.3:  # the tool on offer, every asked value in the prompt
            kw["tools"] = [lookup_tool()]
    else:
        question, missing = _lookup_question(rng)
        messages = [{"role": "user", "content": question}]
        if fmt in (Format.ANSWER, Format.ANSWER_THINK):
            messages += _tool_turns(rng, missing)
        kw["tools"] = [lookup_tool()]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return str(text)


def render_prompts(tok: Any, n: int, seed: int) -> list[tuple[Format, list[int]]]:
    """`n` prompts drawn with the weights of `MIX`, as (format, token ids)."""
    rng = random.Random(seed)
    formats, weights = zip(*MIX.items(), strict=True)
    out = []
    for _ in range(n):
        fmt = rng.choices(formats, weights=weights)[0]
        out.append((fmt, tok(render(tok, rng, fmt), add_special_tokens=False)["input_ids"]))
    return out
