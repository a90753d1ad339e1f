"""The eval gate: a task's problems through `/v1/completions`, scored, against a bar.

Greedy (temperature 0), `max_tokens = task.ANSWER_MAX_TOKENS`, `stop = task.STOP`, at most
`concurrency` requests in flight over one shared client. A request that fails counts as a
wrong answer and is reported (the gate must not pass by skipping what it cannot reach).
`tandem eval` prints `accuracy: X (k/N)` and exits non-zero below `--min-accuracy`.
Tool-use tasks (`TaskMode.TOOL_LOOP`) run their chat loop in orchestrator/eval_tools.py and
report through the same `EvalResult` and `report`.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import httpx

from orchestrator.client import ServerError, error_text, first_model, make_client
from orchestrator.progress import Progress


class Problem(Protocol):
    prompt: str
    answer: str


class Task(Protocol):
    """What orchestrator.tasks.<name> modules provide."""

    ANSWER_MAX_TOKENS: int
    STOP: str | None

    def make_problems(self, n: int, seed: int) -> list[Any]: ...

    def score(self, problem: Any, completion: str) -> bool: ...


@dataclass
class EvalResult:
    total: int
    correct: int = 0
    failed: int = 0  # requests that got no completion (counted as wrong)
    done: int = 0  # problems finished, right, wrong or failed (what a Ctrl-C reports)
    # The first few distinct failure messages, each with how many requests it failed.
    errors: dict[str, int] = field(default_factory=dict)
    # Multi-step tasks: how many problems passed each step (printed under the accuracy line).
    stages: dict[str, int] = field(default_factory=dict)

    def fail(self, message: str) -> None:
        """Count one failed request (a wrong answer) and keep its message."""
        self.failed += 1
        if message in self.errors or len(self.errors) < 5:
            self.errors[message] = self.errors.get(message, 0) + 1

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


async def _complete(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """One completion's text; ServerError with the reason if there is none."""
    try:
        resp = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise ServerError(f"{type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ServerError(error_text(resp))
    try:
        return str(resp.json()["choices"][0]["text"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"malformed completion body: {resp.text[:200]}") from None


async def run_eval(
    url: str,
    task: Task,
    samples: int,
    concurrency: int,
    seed: int,
    model: str = "",
    api_key: str = "",
    progress_stream: IO[str] | None = None,
    timeout_s: float = 600.0,
    result: EvalResult | None = None,
) -> EvalResult:
    """Send `samples` problems of `task` to `url`, `concurrency` at a time; score them, into
    `result` when given (filled as problems finish: a Ctrl-C reports it)."""
    problems = task.make_problems(samples, seed)
    result = result if result is not None else EvalResult(total=0)
    result.total = len(problems)
    task_name = getattr(task, "__name__", "task").rsplit(".", 1)[-1]  # a task is a module
    progress = Progress(len(problems), f"eval {task_name}", progress_stream or sys.stderr)
    sem = asyncio.Semaphore(concurrency)
    async with make_client(url, api_key, timeout_s, concurrency) as client:
        name = await first_model(client, model)  # ServerError if unreachable: nothing to score

        async def one(problem: Any) -> None:
            body: dict[str, Any] = {"model": name, "prompt": problem.prompt,
                                    "max_tokens": task.ANSWER_MAX_TOKENS, "temperature": 0.0}
            if task.STOP is not None:
                body["stop"] = [task.STOP]
            async with sem:
                try:
                    text = await _complete(client, body)
                except ServerError as exc:
                    result.fail(str(exc))
                    progress.advance(ok=False)
                else:
                    result.correct += bool(task.score(problem, text))
                    progress.advance()
                result.done += 1

        try:
            await asyncio.gather(*(one(p) for p in problems))
        finally:
            progress.close()
    return result


def report(result: EvalResult, min_accuracy: float, out: IO[str], err: IO[str]) -> int:
    """Print the verdict; 0 if accuracy >= min_accuracy and nothing failed badly, else 1."""
    print(f"accuracy: {result.accuracy:.3f} ({result.correct}/{result.total})", file=out)
    for stage, passed in result.stages.items():
        print(f"  {stage}: {passed}/{result.total}", file=err)
    if result.failed:
        print(f"failed requests: {result.failed}/{result.total} (counted as wrong); the errors:",
              file=err)
        for e, n in result.errors.items():
            print(f"  {e} ({n} request{'s' if n > 1 else ''})", file=err)
    if result.accuracy < min_accuracy:
        print(f"FAIL: accuracy {result.accuracy:.3f} is below --min-accuracy {min_accuracy:.3f}",
              file=err)
        return 1
    return 0
