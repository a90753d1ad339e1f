"""/v1/completions with a list of prompts (OpenAI's and vLLM's batched prompts): n choices for
each prompt, prompt p's choice j at index p * n + j, each its own worker request on its own
prompt, seeded seed + j as vLLM seeds every prompt's choices; usage counts each prompt once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import ScriptedWorker, fast_config, workers
from tests.gateway.test_agents_openai import client_for
from tests.gateway.test_gateway_api import script_for

pytestmark = pytest.mark.anyio

PROMPTS = ["hello", "the quick brown", "dog"]


@pytest.mark.parametrize("stream", [False, True])
async def test_n_choices_for_each_prompt(tok_dir: Path, stream: bool) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    w = ScriptedWorker(script=script_for(tok_dir, "hello world", finish_reason="stop"))
    async with workers(w), client_for(fast_config(tok_dir, workers=(w.url,))) as client:
        kw: dict[str, Any] = dict(model="tiny", prompt=PROMPTS, n=2, seed=10, max_tokens=8,
                                  extra_body={"return_token_ids": True})
        texts: dict[int, str] = {}
        prompt_ids: dict[int, list[int]] = {}
        if stream:
            async for chunk in await client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw):
                usage = chunk.usage or None
                for ch in chunk.choices:
                    texts[ch.index] = texts.get(ch.index, "") + ch.text
                    extra = ch.model_extra or {}
                    if extra.get("prompt_token_ids"):
                        prompt_ids[ch.index] = extra["prompt_token_ids"]
        else:
            r = await client.completions.create(**kw)
            usage = r.usage
            for ch in r.choices:
                texts[ch.index] = ch.text
                prompt_ids[ch.index] = (ch.model_extra or {})["prompt_token_ids"]
        assert sorted(texts) == list(range(6)) and set(texts.values()) == {"hello world"}
        assert prompt_ids == {i: ids[i // 2] for i in range(6)}
        assert usage is not None and usage.prompt_tokens == sum(len(p) for p in ids)
        assert usage.completion_tokens == 6 * len(w.script.tokens)
        sent = {q.request_id.rsplit("-", 1)[1]: q for q in w.requests}
        assert {int(i): list(q.prompt_token_ids) for i, q in sent.items()} == prompt_ids
        assert {int(i): q.sampling.seed for i, q in sent.items()} == {
            i: 10 + i % 2 for i in range(6)}


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 worker requests: past n's bound of 128
    ({"prompt": [[5], [5] * 70]}, "prompt"),  # the second prompt past max_model_len (64)
    ({"prompt": ["a", ""]}, "prompt"),
])
async def test_a_batch_refused_whole(tok_dir: Path, body: dict[str, Any], param: str) -> None:
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), client_for(fast_config(tok_dir, workers=(w.url,))) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="tiny", max_tokens=4, **body)
        err = info.value.body
        assert isinstance(err, dict) and err["param"] == param, err
        assert not w.requests
