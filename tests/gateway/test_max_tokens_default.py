"""max_tokens left out (or null): 16 on /v1/completions, OpenAI's default (vLLM's and SGLang's
too), capped at what fits after the prompt; on chat what fits in max_model_len, as vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gateway.gw_doubles import ScriptedWorker, fast_config, running_app, workers
from tests.gateway.test_gateway_api import script_for

pytestmark = pytest.mark.anyio


async def test_max_tokens_left_out(tok_dir: Path) -> None:
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))  # max_model_len 64
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for absent in ({}, {"max_tokens": None}):
            r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], **absent})
            assert r.status_code == 200 and w.requests[-1].sampling.max_tokens == 16
        r = await c.post("/v1/completions", json={"prompt": [5] * 55})
        assert r.status_code == 200 and w.requests[-1].sampling.max_tokens == 9  # what fits
        r = await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "a"}]})
        n_prompt = len(w.requests[-1].prompt_token_ids)
        assert r.status_code == 200 and w.requests[-1].sampling.max_tokens == 64 - n_prompt
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "min_tokens": 17})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "min_tokens"
        assert "16 when left out (the default)" in err["message"]
