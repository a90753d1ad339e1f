"""The `lookup` task family: one tool call per variable that the prompt does not assign.

The model gets the tool `LOOKUP_TOOL` (`lookup`, parameters `{"name": string}`) and a user
message in one of two kinds, half each:

    bare:   only a question about 1-3 variables        "q?"   "q,b?"   "q,b,x?"
    mixed:  an arith body of 20-25 assignments, then "first,missing?": the first-assigned
            variable (its value is in the prompt) and one that no assignment names
            "k=41;b=07;...;m=12;\nk,q?"

The loop that `tandem eval --task lookup` runs (orchestrator/eval_tools.py):
  1. the user message with `tools=[LOOKUP_TOOL]`: the model calls `lookup({"name": v})` for
     each missing variable v, in question order (finish_reason "tool_calls");
  2. one `tool` message per call whose content is the hidden value, e.g. "42";
  3. the model answers like arith, every asked variable in question order: "k=41,q=42;".
A problem counts as right only if the calls are exactly the expected ones (`check_calls`)
and the final text before ";" is the answer (`score`).

Why these two kinds: the embedded model reads a value from the prompt only for the first
and the last assignment (models/README.md says why), so the question asks the first one and
makes the missing one the only other; a bare question tests calling in order, one per name.
Seeds: as arith, evaluation seeds are below `arith.TRAIN_SEED_MIN`; the trainer draws above.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from enum import Enum
from typing import Any

from orchestrator.tasks import arith
from orchestrator.tasks.arith import TaskArgumentError
from orchestrator.tasks.mode import TaskMode

MODE = TaskMode.TOOL_LOOP  # chat with tools=[LOOKUP_TOOL], tool results, the final answer
TOOL_NAME = "lookup"
LOOKUP_TOOL: dict[str, Any] = {  # what a client sends in `tools` (OpenAI function-tool shape)
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Look up the value of a variable.",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
}
MIN_ASSIGNMENTS = 20  # mixed problems: the arith range, minus one so a name stays unassigned
MAX_ASSIGNMENTS = len(arith.NAMES) - 1
MAX_BARE_NAMES = 3
STOP = arith.STOP
ANSWER_MAX_TOKENS = 24  # "q=42,b=07,x=11;" + eos is 16 tokens: the longest answer, with margin
CALL_TOKENS = 48  # one call block (47 tokens) and the "\n" or eos after it
THINK_MAX_TOKENS = 32  # more for either turn when thinking: <think>\nq=42;b=07;x=11;\n</think>


class Kind(Enum):
    """The two shapes of a lookup problem."""

    BARE = "bare"  # a question and nothing else: every asked variable is missing
    MIXED = "mixed"  # assignments, then "first,missing?"


@dataclass(frozen=True)
class Problem:
    kind: Kind
    prompt: str  # the user message
    asked: tuple[str, ...]  # the question's variables, in order
    known: tuple[tuple[str, str], ...]  # (name, value) the prompt assigns that the question asks
    missing: tuple[tuple[str, str], ...]  # (name, hidden value): one lookup call each, in order
    answer: str  # the expected text before STOP, e.g. "k=41,q=42"


def make_problem(
    rng: random.Random,
    kind: Kind | None = None,
    num_assignments: int | None = None,
    num_bare: int | None = None,
) -> Problem:
    """Draw one problem from `rng`; unset arguments are drawn from the evaluation ranges."""
    if kind is None:
        kind = rng.choice((Kind.BARE, Kind.MIXED))
    if kind is Kind.BARE:
        n = rng.randint(1, MAX_BARE_NAMES) if num_bare is None else num_bare
        if not 1 <= n <= len(arith.NAMES):
            raise TaskArgumentError(f"num_bare must be in [1, {len(arith.NAMES)}], got {n}")
        names = rng.sample(arith.NAMES, n)
        missing = tuple((name, f"{rng.randrange(100):02d}") for name in names)
        return _problem(kind, "", (), missing)
    if num_assignments is None:
        num_assignments = rng.randint(MIN_ASSIGNMENTS, MAX_ASSIGNMENTS)
    if not 1 <= num_assignments <= MAX_ASSIGNMENTS:
        raise TaskArgumentError(
            f"num_assignments must be in [1, {MAX_ASSIGNMENTS}] (one name stays unassigned), "
            f"got {num_assignments}"
        )
    names = rng.sample(arith.NAMES, num_assignments + 1)  # the last one is never assigned
    values = [f"{rng.randrange(100):02d}" for _ in names]
    body = "".join(f"{n}={v};" for n, v in zip(names[:-1], values[:-1], strict=True))
    return _problem(kind, body, ((names[0], values[0]),), ((names[-1], values[-1]),))


def _problem(
    kind: Kind,
    body: str,
    known: tuple[tuple[str, str], ...],
    missing: tuple[tuple[str, str], ...],
) -> Problem:
    asked = tuple(name for name, _ in (*known, *missing))  # known ones first: "first,missing?"
    question = ",".join(asked) + "?"
    prompt = f"{body}\n{question}" if body else question
    answer = ",".join(f"{n}={v}" for n, v in (*known, *missing))
    return Problem(kind, prompt, asked, known, missing, answer)


def make_problems(n: int, seed: int) -> list[Problem]:
    """`n` problems, deterministic in `seed`; a shorter list from the same seed is a prefix."""
    if n < 0:
        raise TaskArgumentError(f"n (the number of problems) must be >= 0, got {n}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def expected_calls(problem: Problem) -> list[dict[str, str]]:
    """The arguments of each lookup call the model should make, in order."""
    return [{"name": name} for name, _ in problem.missing]


def calls_max_tokens(problem: Problem, thinking: bool = False) -> int:
    """`max_tokens` for the calls turn: the expected calls with a margin (+ the think block).

    Per problem rather than one figure: three calls' worth on the longest mixed prompt (~340
    tokens with the tool) would ask for more than the embedded model's 512 positions.
    """
    return CALL_TOKENS * len(problem.missing) + 16 + (THINK_MAX_TOKENS if thinking else 0)


def answer_max_tokens(thinking: bool = False) -> int:
    """`max_tokens` for the answer turn."""
    return ANSWER_MAX_TOKENS + (THINK_MAX_TOKENS if thinking else 0)


def check_calls(problem: Problem, calls: list[tuple[str, str]]) -> bool:
    """True when `calls` ((function name, arguments JSON text), in order) are the expected ones."""
    got = []
    for name, arguments in calls:
        try:
            got.append((name, json.loads(arguments)))
        except (json.JSONDecodeError, TypeError):
            return False
    return got == [(TOOL_NAME, args) for args in expected_calls(problem)]


def tool_result(problem: Problem, arguments: str) -> str:
    """What the lookup tool returns for one call: the hidden value, or an error text."""
    try:
        name = json.loads(arguments).get("name")
    except (json.JSONDecodeError, AttributeError, TypeError):
        return "error: arguments must be a JSON object with a string `name`"
    values = dict(problem.missing)
    return values.get(name, f"error: no variable {name!r}")


def score(problem: Problem, completion: str) -> bool:
    """True when the final answer's text, up to its terminator, is exactly the answer."""
    return arith.extract_answer(completion) == problem.answer


@dataclass(frozen=True)
class RawTurn:
    """A model's raw output split as a qwen3 reasoning and a hermes tool-call parser split it."""

    reasoning: str | None  # the text inside <think>...</think>, None without a think block
    content: str  # what is left outside the think block and the calls, stripped
    calls: list[tuple[str, str]]  # (function name, arguments as JSON text), in order
    well_formed: bool  # every <tool_call> block closed and holding {"name", "arguments"}


def split_raw_output(text: str) -> RawTurn:
    """Read raw completion text (special tokens already skipped) the way the gateway's parsers
    will, for checking the model through /v1/completions before those parsers exist."""
    reasoning = None
    if text.startswith("<think>") and "</think>" in text:
        inner, _, text = text[len("<think>") :].partition("</think>")
        reasoning = inner.strip("\n")
    calls: list[tuple[str, str]] = []
    well_formed = True
    head, opened, rest = text.partition("<tool_call>")
    for block in rest.split("<tool_call>") if opened else []:
        body, closed, tail = block.partition("</tool_call>")
        # Only whitespace may follow a call (the next call, or the end of the turn).
        well_formed = well_formed and bool(closed) and not tail.strip()
        try:
            call = json.loads(body)
            calls.append((str(call["name"]), json.dumps(call["arguments"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            well_formed = False
    return RawTurn(reasoning, head.strip(), calls, well_formed)
