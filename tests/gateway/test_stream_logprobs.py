"""Streamed chat logprobs are the non-streamed ones: every output token's, once, in order.

A token whose text the gateway holds back (a possible stop-string prefix, a tool-call marker a
parser swallows) adds no delta; its logprob must still reach the client, on a later chunk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers

pytestmark = pytest.mark.anyio


def streamed_logprob_tokens(text: str) -> tuple[list[str], str, int]:
    """The logprob tokens, the content and the usage's completion_tokens of an SSE body."""
    tokens: list[str] = []
    content = ""
    used = -1
    for event in text.split("\n\n")[:-1]:
        payload = event.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        chunk: dict[str, Any] = json.loads(payload)
        if chunk.get("usage"):
            used = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            tokens += [e["token"] for e in (choice.get("logprobs") or {}).get("content", [])]
    return tokens, content, used


@pytest.mark.parametrize("stop", [["o w"], ["lo", "ld"], None])
async def test_streamed_logprobs_are_the_non_streamed_ones(tok_dir: Path,
                                                           stop: list[str] | None) -> None:
    ids = Tokenizer.from_dir(tok_dir).encode("hello world", add_special_tokens=False)
    w = ScriptedWorker(script=Script(tokens=ids, finish_reason="stop"))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                            "logprobs": True, "top_logprobs": 1, "stop": stop}
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        want = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
        assert len(want) == whole["usage"]["completion_tokens"]
        r = await c.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        got, content, used = streamed_logprob_tokens(r.text)
    assert content == whole["choices"][0]["message"]["content"]
    assert (got, used) == (want, len(want))


@pytest.mark.parametrize("stop", [["o w"], None])
async def test_streamed_completion_logprobs_and_ids_end_at_the_stop(tok_dir: Path,
                                                                    stop: list[str] | None) -> None:
    ids = Tokenizer.from_dir(tok_dir).encode("hello world", add_special_tokens=False)
    w = ScriptedWorker(script=Script(tokens=ids, finish_reason="stop"))
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 20, "logprobs": 1, "stop": stop,
                            "return_token_ids": True}
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        r = await c.post("/v1/completions", json={**body, "stream": True})
    tokens: list[str] = []
    got_ids: list[int] = []
    for event in r.text.split("\n\n")[:-2]:  # the last is [DONE]
        choice = json.loads(event.removeprefix("data: "))["choices"][0]
        tokens += (choice.get("logprobs") or {}).get("tokens", [])
        got_ids += choice.get("token_ids") or []
    assert (tokens, got_ids) == (whole["logprobs"]["tokens"], whole["token_ids"])
