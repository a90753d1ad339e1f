"""A large request is planned (parsed, templated, tokenized) on a thread, not the event loop:
a 2 MB prompt held every other client's stream for ~0.7 s while it was tokenized there."""

from __future__ import annotations

import threading

import pytest

from gateway.serving import OFF_LOOP_BYTES, GenerationHandler
from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import (
    Script,
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.anyio


async def test_a_large_body_is_planned_off_the_event_loop(tok_dir, monkeypatch):
    on_loop: list[bool] = []
    plan = GenerationHandler._plan

    def spy(self: GenerationHandler, body: bytes, chat: bool):  # type: ignore[no-untyped-def]
        on_loop.append(threading.current_thread() is threading.main_thread())
        return plan(self, body, chat)

    monkeypatch.setattr(GenerationHandler, "_plan", spy)
    w = ScriptedWorker(script=Script(tokens=Tokenizer.from_dir(tok_dir).encode(
        "hi", add_special_tokens=False)))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        await wait_workers(c)
        small = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert small.status_code == 200, small.text
        big = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a " * OFF_LOOP_BYTES}], "max_tokens": 2})
        # past the worker's context: the 400 comes from the plan, made on a thread
        assert big.status_code == 400 and "context" in big.text, big.text
    assert on_loop == [True, False]
