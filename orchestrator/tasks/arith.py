"""The `arith` task family: look up values stated pages earlier in a multi-page prompt.

A prompt assigns two-digit values to 20-26 distinct one-letter variables and then asks for
two of them: the FIRST-assigned variable (its name and value are the prompt's first five
tokens, inside the first KV page at page size 16) and the LAST-assigned one (just before the
question, in the prompt's last page):

    prompt:     "k=41;b=07;x=93;...;m=12;\nk,m?"
    completion: "k=41,m=12;"          (then the model's eos token)

The answer is the text before the terminator `STOP` (";"): "k=41,m=12". So a lost or
corrupted first page changes the answer of every problem (and so does a lost last page); a
model that answers from the wrong cache, or from a page that was never written, fails.

Why first-and-last rather than a variable chosen at random (or a sum, as the name "arith"
once promised): on this project's CPUs a ~1M-parameter model has to learn the task in
minutes. Measured (see models/README.md and shared notes/embedded-model.md): asking for a
random variable stayed at <= 8% exact match after 12k steps of batch 32, while
first-and-last reaches >= 0.99 in ~450-650 steps. The name "arith" stays for the CLI.

Prompts are 106-136 characters, i.e. tokens with the embedded character-level tokenizer
(7-9 pages at page size 16).

Seeds: evaluation uses seeds in [0, TRAIN_SEED_MIN); models/train_arith.py draws only from
seeds >= TRAIN_SEED_MIN, so training and evaluation problems come from disjoint seed streams.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from orchestrator.tasks.mode import TaskMode

MODE = TaskMode.COMPLETION  # raw prompts through /v1/completions
NAMES = string.ascii_lowercase  # 26 one-letter variable names, distinct within a prompt
MIN_ASSIGNMENTS = 20  # 20 * 5 + 6 = 106 characters: >= 64 tokens (4 pages) with margin
MAX_ASSIGNMENTS = 26
STOP = ";"  # the completion's terminator; the answer is the text before it
ANSWER_MAX_TOKENS = 16  # "k=41,m=12;" is 10 tokens (+ eos) with the embedded tokenizer
# Seeds below this are evaluation seeds; training draws only from seeds at or above it.
TRAIN_SEED_MIN = 1 << 32


class TaskArgumentError(ValueError):
    """A `make_problems` argument is out of range; the message names it and the fix."""


@dataclass(frozen=True)
class Problem:
    prompt: str  # the raw prompt text (sent as-is to /v1/completions, or as the user message)
    answer: str  # the expected completion text before STOP, e.g. "k=41,m=12"


def make_problem(rng: random.Random, num_assignments: int | None = None) -> Problem:
    """Draw one problem from `rng`; `num_assignments` defaults to the evaluation range."""
    if num_assignments is None:
        num_assignments = rng.randint(MIN_ASSIGNMENTS, MAX_ASSIGNMENTS)
    if not 2 <= num_assignments <= len(NAMES):
        raise TaskArgumentError(
            f"num_assignments must be in [2, {len(NAMES)}], got {num_assignments}"
        )
    # Distinct names: each name in the question matches exactly one assignment.
    names = rng.sample(NAMES, num_assignments)
    values = [f"{rng.randrange(100):02d}" for _ in names]
    # Asked: the first page's assignment and the one just before the question.
    first, last = 0, num_assignments - 1
    body = "".join(f"{n}={v};" for n, v in zip(names, values, strict=True))
    prompt = f"{body}\n{names[first]},{names[last]}?"
    answer = f"{names[first]}={values[first]},{names[last]}={values[last]}"
    return Problem(prompt=prompt, answer=answer)


def make_problems(n: int, seed: int) -> list[Problem]:
    """`n` problems, deterministic in `seed`; a shorter list from the same seed is a prefix."""
    if n < 0:
        raise TaskArgumentError(f"n (the number of problems) must be >= 0, got {n}")
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def solve(prompt: str) -> str:
    """The answer computed from the prompt text alone (a reference solver for tests and tools).

    Reads every `name=value;` assignment and the closing `first,last?` question.
    """
    body, _, question = prompt.rpartition("\n")
    if not question.endswith("?") or question.count(",") != 1:
        raise TaskArgumentError(f"prompt must end with a 'x,y?' question line, got {question!r}")
    values = dict(item.split("=", 1) for item in body.split(";") if item)
    asked = question[:-1].split(",")
    return ",".join(f"{name}={values[name]}" for name in asked)


def extract_answer(completion: str) -> str:
    """The text before the first STOP, whitespace-stripped (a server may already have cut STOP)."""
    return completion.split(STOP, 1)[0].strip()


def score(problem: Problem, completion: str) -> bool:
    """True when the raw generated text, up to its terminator, is exactly the answer."""
    return extract_answer(completion) == problem.answer
