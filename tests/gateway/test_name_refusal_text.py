"""The 400 for a message `name` the chat template drops reads as English for every role
("a user message", "an assistant message")."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.gateway.gw_doubles import fast_config, workers
from tests.gateway.test_agents_openai import client_for, scripted

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("role,phrase", [("user", "a user message's name"),
                                         ("system", "a system message's name"),
                                         ("assistant", "an assistant message's name")])
async def test_dropped_name_error_reads_right(hermes_dir: Path, role: str, phrase: str) -> None:
    w = scripted(hermes_dir, "ok")
    messages = [{"role": role, "content": "hi", "name": "bob"}]
    if role != "user":
        messages.append({"role": "user", "content": "hi"})
    async with workers(w), client_for(fast_config(hermes_dir, workers=(w.url,))) as client:
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
    assert phrase in str(e.value)
