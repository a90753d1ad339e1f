"""Fields of the OpenAI surface found silently dropped or misnamed by driving a live cluster with
the openai client and raw HTTP: each is honoured or a 400 naming the field the client sent."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers

pytestmark = pytest.mark.anyio


async def _error(c: httpx.AsyncClient, path: str, body: dict) -> tuple[int, dict]:
    r = await c.post(path, json=body)
    return r.status_code, r.json().get("error") or {}


async def test_message_fields_a_template_reads_on_another_role_are_refused(tok_dir) -> None:
    """tool_call_id outside a tool message, reasoning outside an assistant one: the template
    never reads them there, so they were dropped with a 200."""
    w = ScriptedWorker(script=Script(tokens=[70, 71], finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for role, field in [("user", "tool_call_id"), ("system", "tool_call_id"),
                            ("assistant", "tool_call_id"), ("user", "reasoning_content"),
                            ("user", "reasoning"), ("system", "reasoning_content")]:
            msgs = [{"role": role, "content": "x", field: "c1"}]
            if role != "user":
                msgs.append({"role": "user", "content": "y"})
            got, err = await _error(c, "/v1/chat/completions", {"messages": msgs})
            assert (got, err.get("param")) == (400, "messages"), (role, field, err)
            assert field.split("_")[0] in err["message"], err
        # where the template reads them they still pass
        ok = [{"role": "user", "content": "x"},
              {"role": "assistant", "content": "a", "reasoning_content": "r"},
              {"role": "user", "content": "y"}]
        assert (await c.post("/v1/chat/completions", json={"messages": ok})).status_code == 200


async def test_a_chat_prompt_past_the_context_names_messages(tok_dir) -> None:
    """The 400 names the field the prompt came from: `messages` for chat (it said `prompt`)."""
    w = ScriptedWorker(max_model_len=64, script=Script(tokens=[70]))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        long = "hello world " * 40
        got, err = await _error(c, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": long}]})
        assert (got, err["param"], err["code"]) == (400, "messages", "context_length_exceeded")
        got, err = await _error(c, "/v1/completions", {"prompt": long})
        assert (got, err["param"], err["code"]) == (400, "prompt", "context_length_exceeded")


async def test_requests_sharing_an_x_request_id_do_not_abort_each_other(tok_dir) -> None:
    """The header is the client's to choose (a retrying client resends it, a proxy may stamp a
    constant): it names the response and leads the workers' request id, unique. Both had
    the same attempt id, so the workers' abort of the one a stop string ended cut the other
    short ("the worker ended the request with finish_reason 'abort'")."""
    tok = Tokenizer.from_dir(tok_dir)
    tokens = tok.encode(" alpha beta gamma delta" + " epsilon zeta" * 4, add_special_tokens=False)
    w = ScriptedWorker(max_model_len=128, script=Script(tokens=tokens, finish_reason="stop",
                                                        delay_s=0.02))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        head = {"X-Request-Id": "same"}
        body = {"prompt": "x", "max_tokens": len(tokens)}
        cut, whole = await asyncio.gather(
            c.post("/v1/completions", json={**body, "stop": ["beta"]}, headers=head),
            c.post("/v1/completions", json=body, headers=head))
        assert cut.status_code == 200 and cut.json()["choices"][0]["text"] == " alpha "
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["text"] == tok.decode(tokens)
        assert cut.headers["x-request-id"] == whole.headers["x-request-id"] == "same"
        assert cut.json()["id"] == whole.json()["id"] == "cmpl-same"  # the client's name
        ids = {r.request_id for r in w.requests}
        assert len(ids) == 2 and all(i.startswith("same-") for i in ids)


async def test_a_compressed_body_is_a_415_naming_the_encoding(tok_dir) -> None:
    """A gzip body was read as JSON: a 400 "not valid JSON: 'utf-8' codec can't decode byte
    0x8b", which sends the client looking at its JSON."""
    w = ScriptedWorker(script=Script(tokens=[70, 71], finish_reason="stop"))
    raw = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await c.post(path, content=gzip.compress(raw),
                             headers={"content-type": "application/json",
                                      "content-encoding": "gzip"})
            err = r.json()["error"]
            assert (r.status_code, err["code"]) == (415, "unsupported_content_encoding"), r.text
            assert "gzip" in err["message"] and err["type"] == "invalid_request_error"
        r = await c.post("/v1/completions", content=raw,
                         headers={"content-type": "application/json",
                                  "content-encoding": "identity"})
        assert r.status_code == 200, r.text


async def test_a_wrong_method_is_a_405_that_says_which_one_to_use(tok_dir) -> None:
    """The 405 lost the router's Allow header and said only "Method Not Allowed"."""
    w = ScriptedWorker(script=Script(tokens=[70], finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for method, path, allow in [("GET", "/v1/completions", "POST"),
                                    ("PUT", "/v1/chat/completions", "POST"),
                                    ("POST", "/v1/models", "GET")]:
            r = await c.request(method, path)
            assert r.status_code == 405, r.text
            assert allow in r.headers["allow"], r.headers
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and allow in err["message"], err
            assert f"{method} {path}" in err["message"], err


async def test_a_temperature_below_1e_5_samples_greedily(tok_dir) -> None:
    """1e-45 (a float32 denormal) reached the worker, whose logits over it overflowed: NaN
    probabilities, an INTERNAL error, a retry and a 502, each worker charged with a fault.
    vLLM and SGLang sample greedily below their epsilon; so does the gateway, below 1e-5."""
    w = ScriptedWorker(script=Script(tokens=[70], finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for t, sent in [(1e-45, 0.0), (1e-38, 0.0), (9.9e-6, 0.0), (0, 0.0), (2e-5, 2e-5),
                        (0.7, 0.7)]:
            r = await c.post("/v1/completions", json={"prompt": "x", "temperature": t})
            assert r.status_code == 200, r.text
            assert w.requests[-1].sampling.temperature == pytest.approx(sent, rel=1e-6), t


async def test_a_repetition_penalty_that_overflows_the_logits_is_refused(tok_dir) -> None:
    """1e-39 divided the logits into inf: a 502 when sampling, a null logprob when greedy."""
    w = ScriptedWorker(script=Script(tokens=[70], finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for rp in (1e-39, 1e-7, 0):
            got, err = await _error(c, "/v1/completions", {"prompt": "x",
                                                           "repetition_penalty": rp})
            assert (got, err["param"]) == (400, "repetition_penalty"), err
        r = await c.post("/v1/completions", json={"prompt": "x", "repetition_penalty": 1e-6})
        assert r.status_code == 200, r.text
