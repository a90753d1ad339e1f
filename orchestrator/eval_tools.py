"""The eval gate for tool-use tasks (`TaskMode.TOOL_LOOP`, e.g. lookup), through the openai client.

Per problem, greedy (temperature 0), with `tools=[task.LOOKUP_TOOL]`:
  1. the user message -> the reply must finish with "tool_calls" and carry exactly the calls
     `task.check_calls` expects (names, order, JSON arguments);
  2. the assistant message goes back with one `tool` message per call (`tool_call_id`, the
     value from `task.tool_result`) -> the reply's content is scored by `task.score`.
With `enable_thinking` (sent as `chat_template_kwargs`), both replies must also carry a
non-empty `reasoning_content` and no "<think>" left in `content`: the server's reasoning
parser is part of what is gated. A request that fails counts as wrong and is reported, as in
the completion gate; `EvalResult.stages` says how many problems passed each step.
"""

from __future__ import annotations

import asyncio
import sys
from typing import IO, Any

import openai

import orchestrator.client
from orchestrator.client import ServerError, key_hint, pick_model
from orchestrator.eval import EvalResult
from orchestrator.progress import Progress

NO_KEY = "unused"  # the openai client needs some key; this one stands for none given
STAGE_CALLS = "tool calls right"
STAGE_ANSWER = "answers right after the tool results"


def _reasoning(message: Any) -> str:
    # Not a field of the openai types: servers add it, the client keeps it as an extra.
    return str(getattr(message, "reasoning_content", None) or "")


def _thought(message: Any, enable_thinking: bool) -> bool:
    """Thinking off: nothing to check. On: reasoning split out, none left in the content."""
    if not enable_thinking:
        return True
    return bool(_reasoning(message).strip()) and "<think>" not in (message.content or "")


async def first_model_id(client: openai.AsyncOpenAI, model: str = "") -> str:
    """What orchestrator.client.first_model says, through the openai client: asked before any
    problem even with `model` given."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    try:
        page = await client.models.list(timeout=orchestrator.client.MODELS_TIMEOUT_S)
    except openai.APIConnectionError as exc:  # APITimeoutError among them
        raise ServerError(f"cannot reach {url}: {type(exc).__name__}: {str(exc).rstrip('.')}. "
                          "Is the server running?") from None
    except openai.APIStatusError as exc:
        if model and exc.status_code == 404:
            return model
        given = client.api_key != NO_KEY
        raise ServerError(f"GET {client.base_url}models failed: {_error_text(exc)}"
                          + key_hint(exc.status_code, given)) from None
    return pick_model([m.id for m in page.data], model, url)


class ToolLoop:
    """One problem's two turns against the server; `run` says whether it ended right."""

    def __init__(
        self, client: openai.AsyncOpenAI, model: str, task: Any, enable_thinking: bool
    ) -> None:
        self.client, self.model, self.task = client, model, task
        self.enable_thinking = enable_thinking

    async def _ask(self, messages: list[dict[str, Any]], max_tokens: int) -> Any:
        body: dict[str, Any] = {}
        if self.enable_thinking:
            body["chat_template_kwargs"] = {"enable_thinking": True}
        reply = await self.client.chat.completions.create(
            model=self.model, messages=messages,  # type: ignore[arg-type]
            tools=[self.task.LOOKUP_TOOL], temperature=0.0, max_tokens=max_tokens,
            extra_body=body,
        )
        if not reply.choices:
            raise ServerError("chat completion with no choices")
        return reply.choices[0]

    async def run(self, problem: Any, stages: dict[str, int]) -> bool:
        messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
        first = await self._ask(messages, self.task.calls_max_tokens(problem, self.enable_thinking))
        calls = first.message.tool_calls or []
        pairs = [(c.function.name, c.function.arguments) for c in calls]
        if first.finish_reason != "tool_calls" or not self.task.check_calls(problem, pairs):
            return False
        if not _thought(first.message, self.enable_thinking):
            return False
        stages[STAGE_CALLS] += 1
        messages.append({
            "role": "assistant",
            "content": first.message.content or "",
            "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in calls
            ],
        })
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": self.task.tool_result(problem, call.function.arguments)})
        second = await self._ask(messages, self.task.answer_max_tokens(self.enable_thinking))
        right = bool(self.task.score(problem, second.message.content or ""))
        if right and _thought(second.message, self.enable_thinking):
            stages[STAGE_ANSWER] += 1
            return True
        return False


async def run_tool_eval(
    url: str,
    task: Any,
    samples: int,
    concurrency: int,
    seed: int,
    model: str = "",
    api_key: str = "",
    enable_thinking: bool = False,
    progress_stream: IO[str] | None = None,
    timeout_s: float = 600.0,
    result: EvalResult | None = None,
) -> EvalResult:
    """Run the tool loop on `samples` problems of `task`, `concurrency` at a time; score them,
    into `result` when given (filled as problems finish: a Ctrl-C reports it)."""
    problems = task.make_problems(samples, seed)
    result = result if result is not None else EvalResult(total=0)
    result.total, result.stages = len(problems), {STAGE_CALLS: 0, STAGE_ANSWER: 0}
    label = "eval " + getattr(task, "__name__", "tools").rsplit(".", 1)[-1]
    progress = Progress(len(problems), label, progress_stream or sys.stderr)
    sem = asyncio.Semaphore(concurrency)
    # No retries: a request the server failed must count, not be hidden by a second try.
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or NO_KEY,
                                max_retries=0, timeout=timeout_s)
    async with client:
        loop = ToolLoop(client, await first_model_id(client, model), task, enable_thinking)

        async def one(problem: Any) -> None:
            async with sem:
                try:
                    # Awaited first: `x += await ...` would read x before the await and lose
                    # the other tasks' increments.
                    right = await loop.run(problem, result.stages)
                    result.correct += right
                    progress.advance()
                except (openai.APIError, ServerError) as exc:
                    result.fail(_error_text(exc))
                    progress.advance(ok=False)
                result.done += 1

        try:
            await asyncio.gather(*(one(p) for p in problems))
        finally:
            progress.close()
    return result


def _error_text(exc: Exception) -> str:
    """`HTTP 503: message` from an OpenAI-shaped error body, like the completion gate's."""
    if isinstance(exc, openai.APIStatusError):
        body = exc.body  # the client keeps the body's "error" object when there is one
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            body = body["error"]
        message = body.get("message") if isinstance(body, dict) else None
        return f"HTTP {exc.status_code}: {message or exc.message}"
    return f"{type(exc).__name__}: {exc}"
