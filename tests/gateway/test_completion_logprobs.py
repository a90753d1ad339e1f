"""/v1/completions `logprobs: k` as OpenAI defines it: each token's `top_logprobs` holds the k
most likely tokens and always the sampled one (up to k + 1 entries; `logprobs: 0` gives the
sampled token alone), as vLLM answers too. Chat's `top_logprobs` stay the k most likely only."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, workers
from tests.gateway.test_agents_openai import client_for

pytestmark = pytest.mark.anyio


def worker_sampling_below_the_top(tok_dir: Path) -> tuple[ScriptedWorker, list[str], str]:
    """A worker whose every sampled token has a likelier rival; the sampled texts, the rival's."""
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode("hello world", add_special_tokens=False)
    rival = tok.encode(" fox", add_special_tokens=False)[0]
    w = ScriptedWorker(script=Script(tokens=ids, finish_reason="stop", rival=rival))
    texts = [tok.decode([i], skip_special_tokens=False) for i in ids]
    return w, texts, tok.decode([rival], skip_special_tokens=False)


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_completion_top_logprobs_hold_the_sampled_token(tok_dir: Path, k: int) -> None:
    w, texts, rival = worker_sampling_below_the_top(tok_dir)
    async with workers(w), client_for(fast_config(tok_dir, workers=(w.url,))) as client:
        r = await client.completions.create(model="tiny", prompt="hi", max_tokens=20,
                                            logprobs=k)
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens == texts and lp.top_logprobs is not None
        want = [({rival: -0.25} if k else {}) | {t: -0.5} for t in texts]
        assert lp.top_logprobs == want
        streamed: list[dict[str, float]] = []
        async for chunk in await client.completions.create(
                model="tiny", prompt="hi", max_tokens=20, logprobs=k, stream=True):
            for c in chunk.choices:
                streamed += (c.logprobs.top_logprobs or []) if c.logprobs else []
        assert streamed == want
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            logprobs=True, top_logprobs=k)
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and [e.token for e in content] == texts
        assert all([a.token for a in e.top_logprobs] == [rival, e.token][:k] for e in content)
