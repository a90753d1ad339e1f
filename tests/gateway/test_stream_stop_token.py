"""A streamed answer ends as the non-streamed one does when a stop token ends it (the eos, or a
`stop_token_ids` entry): counted, its text not written. The worker sends an output's last
tokens and its end in one Session message; pushed to the client before the end was read, the
stop token's text went out (`<|im_end|>` under skip_special_tokens false, the comma of
stop_token_ids [","]) while the JSON answer left it out. Found driving a live cluster with the
openai client; a real gateway process, so the stream takes the push path."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, workers
from tests.gateway.test_gateway_server import _read_response, gateway_process

pytestmark = pytest.mark.anyio
EOS_ID = 2  # ScriptedWorker's GetInfo eos: <|im_end|> in the test tokenizer


def _streamed(url: str, path: str, body: dict) -> tuple[str, str, int]:
    """Text, finish reason and completion tokens of a streamed answer, read over HTTP/1.1
    (chunked: the gateway pushes each output as it arrives)."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps({**body, "stream": True,
                      "stream_options": {"include_usage": True}}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%b" % (path.encode(), len(raw), raw))
        _, payload, _ = _read_response(s, b"")
    text, finish, tokens, events = "", "", -1, 0
    for e in payload.decode().split("\n\n"):
        if not e.startswith("data: {"):
            continue
        chunk = json.loads(e[6:])
        events += 1
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for ch in chunk["choices"]:
            text += (ch["delta"].get("content") or "") if "delta" in ch else ch["text"]
            finish = ch["finish_reason"] or finish
    assert events >= 5  # an event a token: the outputs were pushed one by one
    return text, finish, tokens


@pytest.mark.parametrize("chat", [False, True])
async def test_a_stop_token_is_not_written_in_a_stream(tok_dir: Path, chat: bool) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    hello = tok.encode("hello world", add_special_tokens=False)
    comma = tok.encode(",", add_special_tokens=False)
    assert len(comma) == 1 and comma[0] not in hello
    cases = [  # (tokens the worker sends, the request's fields)
        ([*hello, EOS_ID], {}),
        ([*hello, EOS_ID], {"skip_special_tokens": False}),
        ([*hello, *comma], {"stop_token_ids": comma}),
        ([*hello, *comma], {"stop_token_ids": comma, "logprobs": True} if chat
         else {"stop_token_ids": comma, "logprobs": 1}),
    ]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    w = ScriptedWorker(max_model_len=128, script=Script(finish_reason="stop", delay_s=0.02))
    async with workers(w), gateway_process(tok_dir, w.url) as url, \
            httpx.AsyncClient(timeout=30) as client:
        for tokens, fields in cases:
            w.script.tokens = tokens
            body = {"max_tokens": 32, **fields,
                    **({"messages": [{"role": "user", "content": "x"}]} if chat
                       else {"prompt": "x"})}
            r = await client.post(url + path, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            whole = (choice["message"]["content"] if chat else choice["text"],
                     choice["finish_reason"], r.json()["usage"]["completion_tokens"])
            assert whole == ("hello world", "stop", len(tokens)), (fields, whole)
            assert await asyncio.to_thread(_streamed, url, path, body) == whole, fields
