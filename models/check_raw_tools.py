"""Check the embedded model's tool calls and thinking through /v1/completions, no parsers needed.

Renders the model's own chat template (from tokenizer_config.json, in a sandboxed jinja2
environment as the gateway does), sends the text as a raw prompt, greedy, and reads the
output the way the hermes tool-call and qwen3 reasoning parsers will
(`lookup.split_raw_output`). Per lookup problem (orchestrator/tasks/lookup.py):

    calls    user question + tools -> exactly the expected <tool_call> blocks, then eos
    answer   + the expected calls and their tool results -> the answer ("k=41,q=42;")
and each again with enable_thinking (a non-empty <think> block first, then the same), plus
arith as one user message with thinking. Prints one accuracy per check.

    .venv/bin/python models/check_raw_tools.py --url http://127.0.0.1:8000 --samples 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import jinja2
import jinja2.sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from orchestrator.tasks import arith, lookup  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parent / "tandem-arith"


def load_template(model_dir: Path) -> jinja2.Template:
    def _raise(message: str) -> None:
        raise jinja2.TemplateError(message)

    source = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def history(problem: lookup.Problem) -> list[dict[str, Any]]:
    """The conversation after the expected calls and their results (what a client sends)."""
    calls = [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": lookup.TOOL_NAME, "arguments": json.dumps(args)}}
        for i, args in enumerate(lookup.expected_calls(problem))
    ]
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"call_{i}", "content": value}
          for i, (_, value) in enumerate(problem.missing)),
    ]


class CheckError(RuntimeError):
    """The server refused a request; the check counts it as wrong and reports it."""


def thought_right(turn: lookup.RawTurn, thinking: bool) -> bool:
    return bool(turn.reasoning) if thinking else turn.reasoning is None


class Checker:
    def __init__(self, client: httpx.AsyncClient, template: jinja2.Template, model: str) -> None:
        self.client, self.template, self.model = client, template, model

    async def complete(self, prompt: str, max_tokens: int) -> tuple[str, str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0}
        resp = await self.client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            raise CheckError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        choice = resp.json()["choices"][0]
        return choice["text"], choice["finish_reason"]

    def render(self, messages: list[dict[str, Any]], thinking: bool, tools: bool = True) -> str:
        kw: dict[str, Any] = {"tools": [lookup.LOOKUP_TOOL]} if tools else {}
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    enable_thinking=thinking, **kw)

    async def calls(self, problem: lookup.Problem, thinking: bool) -> bool:
        prompt = self.render([{"role": "user", "content": problem.prompt}], thinking)
        text, finish = await self.complete(prompt, lookup.calls_max_tokens(problem, thinking))
        turn = lookup.split_raw_output(text)
        return (finish == "stop" and turn.well_formed and not turn.content
                and lookup.check_calls(problem, turn.calls) and thought_right(turn, thinking))

    async def answer(self, problem: lookup.Problem, thinking: bool) -> bool:
        text, _ = await self.complete(self.render(history(problem), thinking),
                                      lookup.answer_max_tokens(thinking))
        turn = lookup.split_raw_output(text)
        return not turn.calls and lookup.score(problem, turn.content) and thought_right(
            turn, thinking)

    async def arith_think(self, problem: arith.Problem) -> bool:
        prompt = self.render([{"role": "user", "content": problem.prompt}], True, tools=False)
        text, _ = await self.complete(prompt, arith.ANSWER_MAX_TOKENS + lookup.THINK_MAX_TOKENS)
        turn = lookup.split_raw_output(text)
        return bool(turn.reasoning) and arith.score(problem, turn.content)


async def run(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    problems = lookup.make_problems(args.samples, args.seed)
    arith_problems = arith.make_problems(args.samples, args.seed)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=600.0) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        checker = Checker(client, load_template(Path(args.model_dir)), model)

        errors: list[str] = []

        async def bounded(coro: Any) -> bool:
            async with sem:
                try:
                    return bool(await coro)
                except CheckError as exc:
                    errors.append(str(exc))
                    return False

        checks: dict[str, list[Any]] = {
            "calls": [checker.calls(p, False) for p in problems],
            "answer": [checker.answer(p, False) for p in problems],
            "calls_think": [checker.calls(p, True) for p in problems],
            "answer_think": [checker.answer(p, True) for p in problems],
            "arith_think": [checker.arith_think(p) for p in arith_problems],
        }
        out = {}
        for name, coros in checks.items():
            right = await asyncio.gather(*(bounded(c) for c in coros))
            out[name] = (sum(right), len(right))
    for e in errors[:5]:
        print(f"failed request (counted as wrong): {e}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234, help="evaluation seed (as tandem eval)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--model", default="", help="served model name (default: the first listed)")
    p.add_argument("--model-dir", default=str(MODEL_DIR), help="where the chat template is read")
    args = p.parse_args(argv)
    for name, (right, total) in asyncio.run(run(args)).items():
        print(f"{name}: {right / total:.3f} ({right}/{total})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
