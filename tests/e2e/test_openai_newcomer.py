"""What a newcomer with the official `openai` client expects of the embedded model served 1P1D,
as OpenAI (and vLLM) answer it: the stream helper's final message fed back in the tool loop,
`/v1/completions` top logprobs that hold the sampled token, and its default of 16 tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value of a variable the question does not assign.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path_factory.mktemp("pd"),
                         model=MODEL) as c:
        yield openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        c.wait_drained()  # raises unless every page and room was freed


def test_tool_loop_with_the_stream_helpers_final_message(client: openai.OpenAI) -> None:
    """The stream helper's message carries `parsed`, each call's `index` and
    `function.parsed_arguments`: sent back as history, the loop goes on (it was a 400)."""
    question = [{"role": "user", "content": "q,b?"}]
    with client.chat.completions.stream(model=MODEL.name, messages=question, tools=[LOOKUP],
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    assert [c.function.arguments for c in msg.tool_calls] == ['{"name": "q"}', '{"name": "b"}']
    results = [{"role": "tool", "tool_call_id": c.id, "content": v}
               for c, v in zip(msg.tool_calls, ["42", "07"], strict=True)]
    r = client.chat.completions.create(model=MODEL.name, tools=[LOOKUP], temperature=0,
                                       messages=[*question, msg, *results])
    assert r.choices[0].message.content == "q=42,b=07;"


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI, k: int) -> None:
    """Sampled hot, tokens below the top come up; each one is in its own top_logprobs."""
    r = client.completions.create(model=MODEL.name, prompt="m,z,k?", max_tokens=12,
                                  temperature=1.5, seed=6, logprobs=k)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    below_the_top = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and len(top) <= k + 1
        below_the_top += logprob < max(top.values())
    assert below_the_top > 0 or k == 0  # the case this test is for came up


def test_completions_default_to_16_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL.name, prompt="a=1;\na?", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_batched_prompts(client: openai.OpenAI, stream: bool) -> None:
    """A list of prompts (it was a 400): n choices for each, at index p * n + j, each the
    answer its own prompt gets alone."""
    prompts = ["a=12;b=34;\nb?", "k=56;m=78;\nk,m?", "z=90;\nz?"]
    kw = dict(model=MODEL.name, temperature=0, max_tokens=8, stop=[";"])
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]  # type: ignore[arg-type]
    texts: dict[int, str] = {}
    if stream:
        for chunk in client.completions.create(prompt=prompts, n=2, stream=True,  # type: ignore
                                               stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or None
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
    else:
        r = client.completions.create(prompt=prompts, n=2, **kw)  # type: ignore[arg-type]
        texts, usage = {ch.index: ch.text for ch in r.choices}, r.usage
    assert texts == {i: alone[i // 2].choices[0].text for i in range(6)}
    assert usage is not None
    assert usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore
    assert usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)  # type: ignore
