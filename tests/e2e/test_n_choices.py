"""`n` > 1 through real clusters (configs/tiny-mono.yaml and configs/tiny-1p1d.yaml) with the
official `openai` client: n choices indexed 0..n-1, streamed and not; with a seed, choice i is
what n = 1 with seed + i gives (so the same request twice gives the same choices, and PD the
same as mono); usage counts the prompt once; greedy choices are identical; tool calls and stop
strings per choice; the later choices' prefills hit the prompt's pages; a client that leaves
mid-stream ends every choice (all pages freed). Gateway-side details: tests/gateway/
test_n_choices.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster
from orchestrator.tasks import arith

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value of a variable the question does not assign.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}
SEED = 4242
HOT = {"temperature": 3.0, "max_tokens": 8}  # near-flat odds: seeds show in the text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["configs/tiny-mono.yaml", "configs/tiny-1p1d.yaml"],
                ids=["mono", "1p1d"])
def cluster(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(request.param, tmp=tmp_path_factory.mktemp("n"), model=MODEL) as c:
        yield c


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)


def problem(seed: int) -> arith.Problem:
    return arith.make_problems(1, seed=seed)[0]


def complete(c: Cluster, prompt: str, **kw: Any) -> Any:
    return client(c).completions.create(model=MODEL.name, prompt=prompt, **kw)


def test_seeded_choices_are_seed_plus_index_and_reproducible(cluster: Cluster) -> None:
    prompt = problem(1).prompt
    r = complete(cluster, prompt, n=3, seed=SEED, logprobs=1, **HOT)
    again = complete(cluster, prompt, n=3, seed=SEED, logprobs=1, **HOT)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.text for ch in r.choices]
    assert texts == [ch.text for ch in again.choices]
    assert len(set(texts)) > 1  # sampled independently
    singles = [complete(cluster, prompt, seed=SEED + i, **HOT) for i in range(3)]
    assert texts == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in r.choices)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # Seeds that differ only above bit 31 sample differently (worker/sampler.py).
    high = [complete(cluster, prompt, seed=s, **HOT).choices[0].text for s in (2**62, 2**63)]
    assert high[0] != high[1]


def test_streamed_chat_choices_match_the_unstreamed_ones(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": problem(2).prompt}]
    kw: dict[str, Any] = {"model": MODEL.name, "messages": messages, "n": 3, "seed": SEED,
                          "logprobs": True, **HOT}
    plain = client(cluster).chat.completions.create(**kw)
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    logprobs: dict[int, int] = {}
    usage = []
    for chunk in client(cluster).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            logprobs[ch.index] = logprobs.get(ch.index, 0) + len(
                ch.logprobs.content or [] if ch.logprobs else [])
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert content == {ch.index: ch.message.content for ch in plain.choices}
    assert finish == {ch.index: ch.finish_reason for ch in plain.choices}
    assert logprobs == {ch.index: len(ch.logprobs.content) for ch in plain.choices}
    assert len(usage) == 1
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)


def test_greedy_choices_are_identical_and_stop_each(cluster: Cluster) -> None:
    p = problem(3)
    r = complete(cluster, p.prompt, n=3, temperature=0, stop=[arith.STOP],
                 max_tokens=arith.ANSWER_MAX_TOKENS)
    one = complete(cluster, p.prompt, temperature=0, stop=[arith.STOP],
                   max_tokens=arith.ANSWER_MAX_TOKENS)
    assert [ch.text for ch in r.choices] == [one.choices[0].text] * 3
    assert arith.score(p, one.choices[0].text)
    assert [ch.finish_reason for ch in r.choices] == ["stop"] * 3
    calls = client(cluster).chat.completions.create(
        model=MODEL.name, messages=[{"role": "user", "content": "q?"}], tools=[LOOKUP],
        temperature=0, max_tokens=64, n=2)
    for ch in calls.choices:
        assert ch.finish_reason == "tool_calls"
        assert [c.function.name for c in ch.message.tool_calls or []] == ["lookup"]
    cluster.wait_drained()


def test_later_choices_hit_the_prompts_pages(cluster: Cluster) -> None:
    """Choice 0 computes the prompt; the other three find its pages in the prefix cache of the
    same (mono or prefill) worker and compute at most its last page each."""
    name = "prefill-0" if "prefill-0" in cluster.workers else "both-0"
    before = cluster.load(name).prompt_tokens_computed
    r = complete(cluster, problem(4).prompt, n=4, max_tokens=2)
    computed = cluster.load(name).prompt_tokens_computed - before
    n_prompt = r.usage.prompt_tokens
    assert n_prompt > 3 * 16  # several pages (page_size 16)
    assert n_prompt <= computed <= n_prompt + 3 * 16, (computed, n_prompt)


def test_a_client_leaving_mid_stream_ends_every_choice(cluster: Cluster) -> None:
    stream = complete(cluster, problem(5).prompt, n=4, max_tokens=200, stream=True,
                      extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.update(ch.index for ch in chunk.choices)
        if len(seen) == 4:
            break
    stream.close()
    loads = cluster.wait_drained()
    assert all(ld.kv_used_pages == 0 for ld in loads.values())


def test_more_choices_than_decode_seats(cluster: Cluster) -> None:
    """n above the decode worker's seats (scheduler.max_num_seqs: 32): the choices that finish
    give their seats to the rest. They held them until the whole response ended, so the 33rd
    waited out gateway.queue_timeout_s (300 s) and the request was a 503."""
    fast = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)
    r = fast.completions.create(model=MODEL.name, prompt=problem(6).prompt, n=40, max_tokens=4,
                                seed=SEED, temperature=1.0)
    assert [ch.index for ch in r.choices] == list(range(40))
    assert all(ch.finish_reason for ch in r.choices)
    loads = cluster.wait_drained()
    assert all(ld.kv_used_pages == 0 for ld in loads.values())
