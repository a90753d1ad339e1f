"""`n` > 1 at the gateway (gateway/choices.py), against scripted workers: one worker request per
choice, seeds seed + i, choices after the first on the worker that computed the prompt, the
bodies and stream events with one index per choice, usage counted once for the prompt, and a
failing choice failing the request with every other choice aborted. Real clusters:
tests/e2e/test_n_choices.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import openai
import pytest

from gateway.chunks import chat_choice, choices_body, completion_choice
from gateway.openai_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    UsageCounts,
)
from tests.gateway.gw_doubles import (
    Script,
    ScriptedFailure,
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)
from tests.gateway.test_gateway_api import script_for, sse_events
from tests.gateway.test_gateway_pd import decode, pd_config, prefill
from tests.gateway.test_partial_failure import SeatedDecode

pytestmark = pytest.mark.anyio


class FailingChoice(ScriptedWorker):
    """Fails the worker request of one choice (its id ends in `-<index>`) after `after`
    messages; the other choices run their script to the end, `delay_s` apart."""

    def __init__(self, index: int, after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.index, self.after = index, after

    async def respond(self, request):  # type: ignore[no-untyped-def]
        sent = 0
        async for msg in super().respond(request):
            if request.request_id.endswith(f"-{self.index}") and sent == self.after:
                raise ScriptedFailure(grpc.StatusCode.INTERNAL, "scripted failure")
            yield msg
            sent += 1


def test_multi_choice_bodies_are_the_pydantic_models_bytes() -> None:
    usage = UsageCounts(7, 9, 4)
    want_usage = Usage(prompt_tokens=7, completion_tokens=9, total_tokens=16,
                       prompt_tokens_details=PromptTokensDetails(cached_tokens=4))
    got = choices_body("cmpl-x", "text_completion", 5, "m",
                       [completion_choice(i, f"t{i}", "stop", None) for i in range(3)], usage)
    want = CompletionResponse(id="cmpl-x", created=5, model="m", usage=want_usage, choices=[
        CompletionChoice(index=i, text=f"t{i}", finish_reason="stop") for i in range(3)])
    assert got == want.model_dump_json().encode()
    got = choices_body("chatcmpl-x", "chat.completion", 5, "m",
                       [chat_choice(i, f"c{i}", None, None, None, "length") for i in range(2)],
                       usage)
    want_chat = ChatCompletionResponse(id="chatcmpl-x", created=5, model="m", usage=want_usage,
                                       choices=[ChatChoice(index=i, finish_reason="length",
                                                           message=ChatMessageOut(content=f"c{i}"))
                                                for i in range(2)])
    assert got == want_chat.model_dump_json().encode()


async def test_each_choice_is_a_worker_request_seeded_seed_plus_index(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hello world", finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", headers={"X-Request-Id": "nn"},
                         json={"prompt": "hello", "n": 3, "seed": 2**64 - 2, "logprobs": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        assert {ch["text"] for ch in body["choices"]} == {"hello world"}
        assert all(ch["finish_reason"] == "stop" for ch in body["choices"])
        assert all(len(ch["logprobs"]["tokens"]) == len(w.script.tokens)
                   for ch in body["choices"])
        assert body["id"] == "cmpl-nn"
        u = body["usage"]
        n_prompt = len(w.requests[0].prompt_token_ids)
        assert u["prompt_tokens"] == n_prompt  # the prompt once, whatever n
        assert u["completion_tokens"] == 3 * len(w.script.tokens)  # summed over the choices
        # the client's X-Request-Id leads each choice's id (the gateway's part made it unique)
        seeds = {_choice(q.request_id): q.sampling.seed for q in w.requests}
        assert seeds == {"nn-0": 2**64 - 2, "nn-1": 2**64 - 1, "nn-2": 0}  # mod 2**64
        assert w.aborts == []  # every choice finished by itself
        # Without a seed no choice gets one (each samples from the worker's own RNG).
        r = await c.post("/v1/completions", json={"prompt": "hello", "n": 2})
        assert r.status_code == 200 and not any(q.sampling.HasField("seed")
                                                for q in w.requests[3:])


async def test_later_choices_go_where_the_prompt_was_computed(tok_dir):
    """Round robin would spread the choices; they follow choice 0 to its worker (whose prefix
    cache holds the prompt). PD: the same prefill worker, a decode worker per choice."""
    ws = [ScriptedWorker(script=script_for(tok_dir, "hello", finish_reason="stop"))
          for _ in range(2)]
    async with workers(*ws), running_app(fast_config(
            tok_dir, workers=tuple(w.url for w in ws), prefill_policy="round_robin")) as c:
        assert len(await wait_workers(c)) == 2  # both healthy: round robin would take both
        for k in range(3):
            r = await c.post("/v1/completions", json={"prompt": "hello", "n": 4},
                             headers={"X-Request-Id": f"r{k}"})
            assert r.status_code == 200, r.text
            on = [sum(q.request_id.startswith(f"r{k}-") for q in w.requests) for w in ws]
            assert sorted(on) == [0, 4], on  # the request's choices all on one worker
    ps, ds = [prefill(), prefill()], [decode(), decode()]
    async with workers(*ps, *ds), running_app(pd_config(tok_dir, ps, ds)) as c:
        assert len(await wait_workers(c)) == 4  # a decode worker not yet healthy takes nothing
        r = await c.post("/v1/completions", json={"prompt": "hello", "n": 4, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert sorted(len(p.requests) for p in ps) == [0, 4]
        assert sum(len(d.requests) for d in ds) == 4  # the decode policy spreads them
        assert all(d.requests for d in ds)
        rooms = {q.disagg.room for d in ds for q in d.requests}
        assert len(rooms) == 4 and rooms == {q.disagg.room for p in ps for q in p.requests}
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


async def test_streamed_choices_carry_their_index_and_one_usage(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hello world", finish_reason="stop",
                                         delay_s=0.002))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": True,
            "logprobs": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = [ch["usage"] for ch in chunks if ch["usage"] is not None]
        text: dict[int, str] = {}
        finish: dict[int, str] = {}
        roles: list[int] = []
        logprobs: dict[int, int] = {}
        for ch in chunks:
            for choice in ch["choices"]:
                i, delta = choice["index"], choice["delta"]
                if "role" in delta:
                    roles.append(i)
                text[i] = text.get(i, "") + delta.get("content", "")
                logprobs[i] = logprobs.get(i, 0) + len((choice["logprobs"] or {})
                                                       .get("content", []))
                if choice["finish_reason"]:
                    finish[i] = choice["finish_reason"]
        assert roles == [0, 1, 2]
        assert text == {i: "hello world" for i in range(3)}
        assert finish == {i: "stop" for i in range(3)}
        assert logprobs == {i: len(w.script.tokens) for i in range(3)}
        assert len(usage) == 1 and usage[0]["completion_tokens"] == 3 * len(w.script.tokens)
        assert usage[0]["prompt_tokens"] == len(w.requests[0].prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_choice_fails_the_request_and_aborts_the_others(tok_dir, stream):
    w = FailingChoice(index=2, after=2, script=Script(tokens=list(range(40, 70)),
                                                      delay_s=0.02))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", headers={"X-Request-Id": "ff"},
                         json={"prompt": "hello", "n": 3, "stream": stream, "max_tokens": 30})
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert "error" in json.loads(events[-2])
        else:
            assert r.status_code >= 500 and r.json()["error"]["message"], r.text
        await asyncio.wait_for(_aborted(w, {"ff-0", "ff-1"}), 5)
    assert w.cancelled >= 2  # the other two choices' worker requests really ended early


@pytest.mark.parametrize("stream", [False, True])
async def test_more_choices_than_decode_seats(tok_dir, stream):
    """n above the decode pool's seats: a choice's seat frees when its decode request ends on
    the worker, not when the whole response is done, so the later choices take the seats of
    the finished ones (they held them until the queue's timeout: a 503 after 300 s)."""
    p, d = prefill(), SeatedDecode(seats=2)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d],
                                                    queue_timeout_s=3.0)) as c:
        await wait_workers(c)
        r = await asyncio.wait_for(c.post("/v1/completions", json={
            "prompt": "hi", "n": 5, "max_tokens": 5, "stream": stream}), 10)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(e) for e in sse_events(r.text)[:-1]]
            assert "error" not in events[-1], events[-1]
            done = {ch["index"] for e in events for ch in e["choices"] if ch["finish_reason"]}
        else:
            done = {ch["index"] for ch in r.json()["choices"] if ch["finish_reason"]}
        assert done == set(range(5))
        assert d.peak <= 2, f"decode held {d.peak} requests at once with 2 seats"
        assert len(d.requests) == 5
        assert all(w["inflight"] == 0 for w in await wait_workers(c))


def _choice(request_id: str) -> str:
    """A choice's worker request id as `<X-Request-Id>-<index>` (the gateway's part left out)."""
    head, _, index = request_id.rpartition("-")
    return f"{head.rpartition('-')[0]}-{index}"


async def _aborted(w: ScriptedWorker, ids: set[str]) -> None:
    while not ids <= {_choice(a.request_id) for a in w.aborts}:
        await asyncio.sleep(0.01)


async def test_a_stop_string_ends_only_its_choice(tok_dir):
    """Choices that stop on a stop string are aborted on their worker at once, and finish with
    "stop"; greedy choices are identical (as vLLM gives them)."""
    w = ScriptedWorker(script=script_for(tok_dir, "hello world hello world",
                                         finish_reason="length"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", headers={"X-Request-Id": "ss"},
                         json={"prompt": "hi", "n": 2, "stop": ["wor"], "temperature": 0})
        body = r.json()
        assert [ch["text"] for ch in body["choices"]] == ["hello ", "hello "]
        assert [ch["finish_reason"] for ch in body["choices"]] == ["stop", "stop"]
        await asyncio.wait_for(_aborted(w, {"ss-0", "ss-1"}), 5)


async def test_openai_client_n_choices(tok_dir):
    w = ScriptedWorker(script=script_for(tok_dir, "hello world", finish_reason="stop"))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=c)
        r = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
        assert [ch.index for ch in r.choices] == [0, 1]
        assert [ch.message.content for ch in r.choices] == ["hello world"] * 2
        best = await client.completions.create(model="tiny", prompt="x", n=2, best_of=2)
        assert len(best.choices) == 2
        with pytest.raises(openai.BadRequestError, match="best_of"):
            await client.completions.create(model="tiny", prompt="x", n=2, best_of=4)


async def test_a_json_choice_cut_by_a_worker_runs_again(tok_dir):
    """Not streamed, the client has seen none of the choices: a decode worker that fails one
    past its first token costs that choice a second run on the other decode worker, and the
    answer carries every choice whole."""
    p = prefill()
    bad = decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_after=2)
    good = decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "n": 2})
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        assert len(texts) == 2 and texts[0] == texts[1] != ""
        assert len(bad.requests) == 1 and len(good.requests) == 2
        assert "tandem_retries_total 1.0" in (await c.get("/metrics")).text
