"""finish_reason of a forced call, as OpenAI answers it: a named `tool_choice` ends the turn
with "stop" (the client asked for that call), `auto` and `required` calls with "tool_calls";
streamed or not (vLLM matches it: vllm-project/vllm#25054)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.gateway.gw_doubles import fast_config, workers
from tests.gateway.test_agents_openai import CALL_Q, LOOKUP, MESSAGES, client_for, collect, scripted

pytestmark = pytest.mark.anyio

NAMED = {"type": "function", "function": {"name": "lookup"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice,finish", [(NAMED, "stop"), ("required", "tool_calls"),
                                           ("auto", "tool_calls")],
                         ids=["named", "required", "auto"])
async def test_forced_call_finish_reason_is_openais(hermes_dir: Path, stream: bool,
                                                    choice: Any, finish: str) -> None:
    w = scripted(hermes_dir, CALL_Q)
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, tools=[LOOKUP],
                                  tool_choice=choice)
        if stream:
            got = await collect(await client.chat.completions.create(stream=True, **kw))
            names, reason = [c["name"] for c in got["calls"].values()], got["finish"]
        else:
            r = await client.chat.completions.create(**kw)
            names = [c.function.name for c in r.choices[0].message.tool_calls or []]
            reason = r.choices[0].finish_reason
        assert (names, reason) == (["lookup"], finish)
