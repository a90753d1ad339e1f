"""Gateway CPU per output token of the chat output path, with and without parsers (not a test).

One request's output is replayed token by token, one token per worker message (how workers
stream at low load), through what the gateway runs for it: the incremental detokenizer and
stop strings (OutputAssembler), the reasoning and tool-call parsers (ChatOutput), and the SSE
events' bytes (gateway/chunks.py), through the streamed response's `StreamEvents.of`, as the
gateway runs them (gateway/streaming.py). Per-token CPU = process time / tokens, best of
--repeat runs.

    .venv/bin/python -m bench.parsers --repeat 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.agents import ChatPlan  # noqa: E402
from gateway.chat_output import ChatOutput  # noqa: E402
from gateway.metrics import LoopHistogram, TokenClock  # noqa: E402
from gateway.output import OutputAssembler  # noqa: E402
from gateway.session import Output  # noqa: E402
from gateway.streaming import StreamEvents  # noqa: E402
from gateway.tokenizer import Tokenizer  # noqa: E402
from tests.gateway.gw_tokenizers import HERMES_TEMPLATE, build_agent_tokenizer  # noqa: E402

THINK = ("<think>\nThe question asks for q. The prompt assigns a, b and c but not q, so the "
         "value has to come from the lookup tool; then add one to it.\n</think>\n\n")
ARGS = json.dumps({"name": "q", "context": "the quick brown fox jumps over the lazy dog " * 2})
CASES = {
    "none": ("", "", "The answer is 42, because a + b = 40 and c = 2. " * 4),
    "qwen3 (reasoning only)": ("qwen3", "", THINK + "The answer is 42, because a + b = 40. " * 2),
    "qwen3 + hermes": ("qwen3", "hermes", THINK + "".join(
        f'<tool_call>\n{{"name": "lookup", "arguments": {ARGS}}}\n</tool_call>\n'
        for _ in range(2))),
    "qwen3_coder": ("", "qwen3_coder", "<tool_call>\n<function=lookup>\n<parameter=name>\nq\n"
                    "</parameter>\n<parameter=context>\n" + "the quick brown fox " * 6 +
                    "\n</parameter>\n</function>\n</tool_call>"),
    "llama3_json": ("", "llama3_json", f'{{"name": "lookup", "parameters": {ARGS}}}; '
                    f'{{"name": "lookup", "parameters": {ARGS}}}'),
    "mistral": ("", "mistral", f"[TOOL_CALLS]lookup[ARGS]{ARGS}[TOOL_CALLS]lookup[ARGS]{ARGS}"),
    "deepseek_v3": ("", "deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                    f"<｜tool▁sep｜>lookup\n```json\n{ARGS}\n```<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>"),
}


def replay(tok: Tokenizer, ids: list[int], reasoning: str, tool: str) -> tuple[float, int]:
    """Process seconds for one request's output, through the steps the gateway takes for a
    chat stream (`StreamEvents.of`); and the number of SSE events it made."""
    plan = ChatPlan(prompt_ids=[1, 2, 3], reasoning_parser=reasoning, tool_parser=tool,
                    tool_parameters={"lookup": {"type": "object", "properties": {
                        "name": {"type": "string"}, "context": {"type": "string"}}}},
                    keep_token_ids=frozenset(tok.token_id(m) for m in ("[TOOL_CALLS]", "[ARGS]")
                                             if tok.token_id(m) is not None))
    msgs = [Output([t], []) for t in ids]
    msgs[-1].finish_reason = "stop"
    t0 = time.process_time()
    out = OutputAssembler(tok, plan.prompt_ids, True, [], -1, plan.keep_token_ids)
    clock = TokenClock(LoopHistogram("itl", "", [1.0]), 1)  # not read: no output arrives timed
    stream = StreamEvents("x", "m", out, ChatOutput(plan), clock, created=0)
    events = sum(len(stream.of(msg)) for msg in msgs)
    return time.process_time() - t0, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(build_agent_tokenizer(Path(tempfile.mkdtemp()), HERMES_TEMPLATE))
    base = None
    for name, (reasoning, tool, text) in CASES.items():
        ids = tok.encode(text, add_special_tokens=False)
        best = min(replay(tok, ids, reasoning, tool)[0] for _ in range(args.repeat))
        us = best / len(ids) * 1e6
        base = us if base is None else base
        print(f"parsers={name}: {us:.1f} us/token ({len(ids)} tokens, "
              f"{len(text) / len(ids):.1f} chars/token; +{us - base:.1f} us over none)")


if __name__ == "__main__":
    main()
