"""What an operator reads: failed requests in the log, /metrics while idle, probes."""

from __future__ import annotations

import grpc
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers

pytestmark = pytest.mark.anyio


def script_for(tok_dir, text: str, **kw) -> Script:
    return Script(tokens=Tokenizer.from_dir(tok_dir).encode(text, add_special_tokens=False), **kw)


@pytest.mark.parametrize(("n", "stream"), [(1, False), (2, False), (2, True)])
async def test_answer_failing_past_its_first_token_is_logged(tok_dir, caplog, n, stream):
    """An answer whose worker fails after two tokens (and again on the retry) is a 5xx the
    operator must see in the log once, at WARNING, with the request's id; a non-streamed one,
    and any with n > 1, were answered with no log line at all."""
    w = ScriptedWorker(script=script_for(
        tok_dir, "one two three", fail_code=grpc.StatusCode.INTERNAL, fail_after=2))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "n": n, "stream": stream},
                         headers={"x-request-id": "req-cut-7"})
        if stream:
            assert r.status_code == 200 and '"code": "internal"' in r.text, r.text
        else:
            assert r.status_code == 502, r.text
        failed = [rec for rec in caplog.records
                  if rec.levelname == "WARNING" and "req-cut-7" in rec.getMessage()]
        assert len(failed) == 1, caplog.text
        assert "internal" in failed[0].getMessage().lower(), failed[0].getMessage()
