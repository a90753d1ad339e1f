"""HTTP API of the gateway against a scripted monolithic worker: shapes, SSE, errors."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

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


def sse_events(text: str) -> list[str]:
    """Payloads of `data: ...` events; asserts the framing is exactly SSE."""
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: "), e
    return [e[len("data: ") :] for e in events]


def script_for(tok_dir, text: str, **kw) -> Script:
    return Script(tokens=Tokenizer.from_dir(tok_dir).encode(text, add_special_tokens=False), **kw)


async def test_completion_json_shape(tok_dir):
    w = ScriptedWorker(
        script=script_for(tok_dir, "hello world", finish_reason="stop", cached_tokens=3)
    )
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "the quick", "max_tokens": 10},
            headers={"X-Request-Id": "req-1"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "req-1"
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["id"] and isinstance(body["created"], int)
        assert body["choices"][0]["text"] == "hello world"
        assert body["choices"][0]["finish_reason"] == "stop"
        n_prompt = len(Tokenizer.from_dir(tok_dir).encode("the quick"))
        assert body["usage"] == {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(w.script.tokens),
            "total_tokens": n_prompt + len(w.script.tokens),
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        sent = w.requests[0]
        assert sent.request_id.startswith("req-1-") and sent.sampling.max_tokens == 10
        assert not sent.HasField("disagg")


async def test_sampling_fields_reach_worker(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": [5, 6, 7],
                "max_tokens": 4,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 7,
                "min_p": 0.1,
                "seed": 123,
                "ignore_eos": True,
                "min_tokens": 2,
                "stop_token_ids": [9],
                "repetition_penalty": 1.1,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "user": "u",
                "logit_bias": {"5": -100, "7": 2.5},
            },
        )
        assert r.status_code == 200, r.text
        s = w.requests[0].sampling
        assert list(w.requests[0].prompt_token_ids) == [5, 6, 7]
        assert (s.temperature, s.top_k, s.seed, s.max_tokens, s.min_tokens) == (0.5, 7, 123, 4, 2)
        assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
        assert s.ignore_eos and list(s.stop_token_ids) == [9]
        assert s.repetition_penalty == pytest.approx(1.1) and s.presence_penalty == 0.5
        assert dict(s.logit_bias) == {5: -100.0, 7: 2.5} and not s.HasField("structured")
        # max_tokens absent: 16, OpenAI's default (tests/gateway/test_max_tokens_default.py)
        r = await c.post("/v1/completions", json={"prompt": [5, 6, 7]})
        assert r.status_code == 200 and w.requests[1].sampling.max_tokens == 16


async def test_seeds_in_openais_signed_range_reach_the_worker_as_their_64_bits(tok_dir):
    """OpenAI's seed is a signed 64-bit integer (vLLM takes the same range); the wire's is
    unsigned: a negative seed travels as its two's complement, the same 64 bits."""
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        for seed, wire in ((-1, 2**64 - 1), (-(2**63), 2**63), (2**64 - 1, 2**64 - 1)):
            r = await c.post("/v1/completions", json={"prompt": [5], "seed": seed})
            assert r.status_code == 200, r.text
            assert w.requests[-1].sampling.seed == wire
        for seed in (-(2**63) - 1, 2**64):
            r = await c.post("/v1/completions", json={"prompt": [5], "seed": seed})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


async def test_chat_json_and_template(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hello", finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 8,
                "logprobs": True,
                "top_logprobs": 1,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        ch = body["choices"][0]
        assert (
            ch["message"] == {"role": "assistant", "content": "hello"}
            and ch["finish_reason"] == "stop"
        )
        assert len(ch["logprobs"]["content"]) == len(w.script.tokens)
        assert ch["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -0.5
        tok = Tokenizer.from_dir(tok_dir)
        prompt = list(w.requests[0].prompt_token_ids)
        assert (
            tok.decode(prompt, skip_special_tokens=False)
            == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
        assert prompt[0] == 1  # <|im_start|> recognized as its special id, not spelled out in bytes
        assert w.requests[0].sampling.max_tokens == 8 and w.requests[0].sampling.logprobs


async def test_completion_stream_sse_and_usage(tok_dir):
    w = ScriptedWorker(
        script=script_for(tok_dir, "héllo 🙂 wörld", finish_reason="stop", cached_tokens=2)
    )
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 20,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        assert text == "héllo 🙂 wörld" and "\ufffd" not in text
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        usage = chunks[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(
            w.script.tokens
        )
        assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
        # without include_usage: no usage chunk
        r = await c.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 20, "stream": True}
        )
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert all(ch.get("usage") is None for ch in chunks)


async def test_chat_stream(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "one two three"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        )
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        tok = Tokenizer.from_dir(tok_dir)
        assert content == tok.decode(w.script.tokens[:2])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_tokens_aborts_worker(tok_dir, stream):
    # "STOP" is split over several tokens; the text before it is kept, the worker is aborted.
    w = ScriptedWorker(
        script=script_for(tok_dir, "one two STOP here and more tokens", delay_s=0.01)
    )
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 30,
                "stop": ["OP h", "zz"],
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            },
        )
        assert r.status_code == 200
        if stream:
            chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
            text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
            finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == "one two ST" and finish == "stop"
        await w.abort_event.wait()
        assert w.aborts[0].request_id == w.requests[0].request_id


async def test_models_workers_metrics(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    w.load.running, w.load.waiting, w.load.kv_used_pages = 2, 1, 7
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
        assert (await c.get("/v1/models/tiny")).json() == models["data"][0]
        missing = await c.get("/v1/models/gpt-4")
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["code"] == "model_not_found"
        assert (
            await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        ).status_code == 200
        for _ in range(100):  # load refresh runs every 50 ms
            ws = (await c.get("/workers")).json()
            if ws[0]["running"] == 2:
                break
            await __import__("asyncio").sleep(0.02)
        assert {
            k: ws[0][k]
            for k in (
                "url",
                "role",
                "healthy",
                "running",
                "waiting",
                "kv_used_pages",
                "kv_total_pages",
            )
        } == {
            "url": w.url,
            "role": "both",
            "healthy": True,
            "running": 2,
            "waiting": 1,
            "kv_used_pages": 7,
            "kv_total_pages": 100,
        }
        m = (await c.get("/metrics")).text
        for name in (
            "tandem_time_to_first_token_seconds_bucket",
            "tandem_inter_token_latency_seconds",
            "tandem_e2e_request_latency_seconds",
            'tandem_requests_total{outcome="success"} 1.0',
            "tandem_kv_transfer_bytes_total",
            "tandem_kv_transfer_failures_total",
            "tandem_bootstrap_failures_total",
            "tandem_cached_tokens_total",
            "tandem_prompt_tokens_total",
            "tandem_generation_tokens_total 2.0",
            'tandem_pool_running{pool="workers"} 2.0',
            "tandem_worker_waiting",
        ):
            assert name in m, name
        assert (await c.get("/health")).status_code == 200


# ---- errors ----


async def _post(c: httpx.AsyncClient, path: str, **kw) -> tuple[int, dict]:
    r = await c.post(path, **kw)
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "code", "param"} <= set(body["error"]), (
        body
    )
    return r.status_code, body["error"]


async def test_request_errors(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with (
        workers(w),
        running_app(fast_config(tok_dir, workers=(w.url,), max_request_bytes=2000)) as c,
    ):
        cases = [
            ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 400, None),
            ({"content": b"[1, 2]"}, 400, None),
            ({"json": {"prompt": 5}}, 400, "prompt"),
            ({"json": {"prompt": "a", "max_tokens": "many"}}, 400, "max_tokens"),
            ({"json": {"max_tokens": 3}}, 400, "prompt"),
            ({"json": {"model": "gpt-9", "prompt": "a"}}, 404, "model"),
            ({"json": {"prompt": "a", "max_tokens": 0}}, 400, "max_tokens"),
            ({"json": {"prompt": "a", "max_tokens": -3}}, 400, "max_tokens"),
            ({"json": {"prompt": "a", "temperature": -0.1}}, 400, "temperature"),
            ({"json": {"prompt": "a", "top_p": 0}}, 400, "top_p"),
            ({"json": {"prompt": "a", "top_p": 1.5}}, 400, "top_p"),
            ({"json": {"prompt": "a", "top_k": -2}}, 400, "top_k"),
            ({"json": {"prompt": "a", "min_p": 1.5}}, 400, "min_p"),
            ({"json": {"prompt": "a", "n": 129}}, 400, "n"),
            ({"json": {"prompt": ["a"] * 129}}, 400, "prompt"),  # 129 choices: past n's bound
            ({"json": {"prompt": [1, 99999]}}, 400, "prompt"),
            ({"json": {"prompt": "a" * 3000}}, 413, None),
            # past the wire's int32 (was a 500) / past max_tokens absent (16)
            ({"json": {"prompt": "a", "min_tokens": 2**40}}, 400, "min_tokens"),
            ({"json": {"prompt": [5, 6, 7], "min_tokens": 17}}, 400, "min_tokens"),
            # past float32 (the wire's): the worker read inf and its 400 named no field
            ({"json": {"prompt": "a", "temperature": 1e39}}, 400, "temperature"),
            ({"json": {"prompt": "a", "repetition_penalty": 1e300}}, 400, "repetition_penalty"),
            # -1 was read as "no logprobs" (a 200 without them); vLLM reads it as all of them
            ({"json": {"prompt": "a", "logprobs": -1}}, 400, "logprobs"),
        ]
        for kwargs, status, param in cases:
            got, err = await _post(c, "/v1/completions", **kwargs)
            assert (got, err["param"]) == (status, param), (kwargs, err)
        _, err = await _post(c, "/v1/completions", json={"prompt": "a", "n": 2, "best_of": 3})
        assert "best_of=3 is not supported" in err["message"]
        got, err = await _post(c, "/v1/chat/completions", json={"messages": "hi"})
        assert got == 400 and err["param"] == "messages"
        # prompt + max_tokens over max_model_len (64): 400 naming both numbers
        got, err = await _post(
            c, "/v1/completions", json={"prompt": list(range(10, 70)), "max_tokens": 10}
        )
        assert (
            got == 400
            and "60" in err["message"]
            and "10" in err["message"]
            and "64" in err["message"]
        )
        got, err = await _post(c, "/v1/completions", json={"prompt": list(range(10, 80))})
        assert got == 400 and "70" in err["message"]
        assert w.requests == []  # none of these reached the worker
        r = await c.get("/v1/nope")
        assert r.status_code == 404 and "error" in r.json()
        # the openai client's responses.create: the answer says what is served instead
        got, err = await _post(c, "/v1/responses", json={"model": "tiny", "input": "hi"})
        assert got == 404 and "POST /v1/responses" in err["message"], err
        assert "/v1/chat/completions" in err["message"], err


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 502),
        (grpc.StatusCode.UNAVAILABLE, 503),
    ],
)
async def test_worker_error_codes(tok_dir, code, status):
    w = ScriptedWorker(script=script_for(tok_dir, "hi", fail_code=code))
    async with (
        workers(w),
        running_app(fast_config(tok_dir, workers=(w.url,), health_interval_s=0.5)) as c,
    ):
        for stream in (False, True):
            got, err = await _post(c, "/v1/completions", json={"prompt": "a", "stream": stream})
            assert got == status, err
            unavailable_again = stream and code == grpc.StatusCode.UNAVAILABLE
            # after UNAVAILABLE the worker is out: the next request finds no healthy worker
            assert err["code"] == ("no_healthy_worker" if unavailable_again else code.name.lower())
        health = (await c.get("/workers")).json()[0]["healthy"]
        # a client error never counts against the worker; UNAVAILABLE takes it out at once
        assert health is (code != grpc.StatusCode.UNAVAILABLE)
        # overload (429) is neither the client's mistake nor our failure: its own outcome
        outcome = {400: "client_error", 429: "rejected"}.get(status, "server_error")
        assert f'tandem_requests_total{{outcome="{outcome}"}} 2.0' in (await c.get("/metrics")).text


async def test_no_healthy_worker_503(tok_dir, caplog):
    w = ScriptedWorker()
    async with workers(w):
        await w.set_serving(False)
        async with running_app(fast_config(tok_dir, workers=(w.url,), startup_wait_s=0.2)) as c:
            assert (await c.get("/health")).status_code == 503
            # Not ready, yet alive: what a liveness probe reads (no restart while workers load).
            live = await c.get("/livez")
            assert live.status_code == 200 and live.json() == {"status": "alive"}
            r = await c.post("/v1/completions", json={"prompt": "a"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert r.headers["retry-after"] == "1"  # it says "retry later": when
            # the gateway's own failures reach its log at WARNING (a client's 4xx stay at DEBUG)
            assert any(rec.levelname == "WARNING" and "no healthy worker" in rec.getMessage()
                       for rec in caplog.records), caplog.text


async def test_a_json_answer_cut_by_a_worker_runs_again_on_another(tok_dir):
    """Mono: the worker fails after two tokens of a non-streamed answer; the client has seen
    nothing, so the request runs again on the other worker and answers 200 in full."""
    bad = ScriptedWorker(script=script_for(
        tok_dir, "one two three", fail_code=grpc.StatusCode.INTERNAL, fail_after=2))
    good = ScriptedWorker(script=script_for(tok_dir, "one two three"))
    async with workers(bad, good), running_app(fast_config(
            tok_dir, workers=(bad.url, good.url), prefill_policy="round_robin")) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "one two three"
        assert len(bad.requests) == 1 and len(good.requests) == 1
        metrics = (await c.get("/metrics")).text
        assert 'tandem_requests_total{outcome="success"} 1.0' in metrics
        assert "tandem_retries_total 1.0" in metrics


async def test_mid_stream_failure_sends_error_event(tok_dir):
    w = ScriptedWorker(
        script=script_for(
            tok_dir, "one two three", fail_code=grpc.StatusCode.INTERNAL, fail_after=2
        )
    )
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        assert err["error"]["code"] == "internal"
        assert len(w.requests) == 1  # no retry after the first token
        metrics = (await c.get("/metrics")).text
        assert 'tandem_requests_total{outcome="server_error"} 1.0' in metrics


async def test_api_key(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with (
        workers(w),
        running_app(fast_config(tok_dir, workers=(w.url,), api_key="sekret")) as c,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            got, err = await _post(c, "/v1/completions", json={"prompt": "a"}, headers=headers)
            assert got == 401 and err["type"] == "authentication_error"
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/v1/models/tiny")).status_code == 401
        assert (await c.get("/health")).status_code == 200
        r = await c.post(
            "/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer sekret"}
        )
        assert r.status_code == 200


async def test_completion_logprobs_and_echo(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hello world", finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "logprobs": 1})
        lp = r.json()["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == "hello world" and lp["token_logprobs"] == [-0.5] * len(
            w.script.tokens
        )
        assert lp["text_offset"][0] == 0 and len(lp["top_logprobs"]) == len(w.script.tokens)
        assert w.requests[0].sampling.logprobs and w.requests[0].sampling.top_logprobs == 1
        got, err = await _post(c, "/v1/completions", json={"prompt": "a", "echo": True})
        assert got == 400 and err["param"] == "echo"
        got, err = await _post(c, "/v1/completions", json={"prompt": "a", "logprobs": 50})
        assert got == 400 and err["param"] == "logprobs"


async def test_generation_routes_below_the_stack(tok_dir, monkeypatch):
    # POST to a generation route skips Starlette's stack; its errors keep their shape, and the
    # same path with another method still meets the router's 405.
    from gateway.serving import GenerationHandler

    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        assert (await c.get("/v1/completions")).status_code == 405
        r = await c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

        async def broken(self, request, chat):
            raise RuntimeError("a bug")

        monkeypatch.setattr(GenerationHandler, "handle", broken)
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "internal gateway error" in r.json()["error"]["message"]
