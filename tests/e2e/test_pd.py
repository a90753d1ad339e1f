"""1P1D end to end: PD answers exactly what mono answers, with each transfer backend, and
leaves nothing behind (pages, rooms) whatever the client does."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster
from orchestrator.tasks import arith

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
NUM_PROMPTS = 200
CONCURRENCY = 16

pytestmark = pytest.mark.slow


async def complete_all(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(prompt: str) -> str:
            async with sem:
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": MODEL.name,
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                    },
                )
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["text"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in arith.make_problems(NUM_PROMPTS, seed=11)]


@pytest.fixture(scope="module")
def mono_outputs(tmp_path_factory: pytest.TempPathFactory, prompts: list[str]) -> list[str]:
    with running_cluster(
        "configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("mono"), model=MODEL
    ) as c:
        out = asyncio.run(complete_all(c.url, prompts, arith.ANSWER_MAX_TOKENS))
        c.wait_drained()
        return out


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_pd_equals_mono_token_for_token(
    backend: str, prompts: list[str], mono_outputs: list[str], tmp_path: Path
) -> None:
    with running_cluster(
        "configs/tiny-1p1d.yaml", f"transfer.backend={backend}", tmp=tmp_path, model=MODEL
    ) as c:
        pd_outputs = asyncio.run(complete_all(c.url, prompts, arith.ANSWER_MAX_TOKENS))
        loads = c.wait_drained()
    mismatches = [
        (i, m, p) for i, (m, p) in enumerate(zip(mono_outputs, pd_outputs, strict=True)) if m != p
    ]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[:3]}"
    prefill, decode = loads["prefill-0"], loads["decode-0"]
    assert decode.prompt_tokens_computed == 0, "decode ran prompt tokens through the model"
    assert prefill.transfer_pages == decode.transfer_pages > 0
    assert prefill.transfer_bytes == decode.transfer_bytes > 0


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_cluster(
        "configs/tiny-1p1d.yaml", tmp=tmp_path_factory.mktemp("pd"), model=MODEL
    ) as c:
        yield c


def test_openai_client_stream_and_not(pd_cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{pd_cluster.url}/v1", api_key="unused")
    problem = arith.make_problems(1, seed=3)[0]
    plain = client.completions.create(
        model=MODEL.name, prompt=problem.prompt, max_tokens=arith.ANSWER_MAX_TOKENS, temperature=0
    )
    stream = client.completions.create(
        model=MODEL.name,
        prompt=problem.prompt,
        max_tokens=arith.ANSWER_MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    )
    chat = client.chat.completions.create(
        model=MODEL.name,
        messages=[{"role": "user", "content": problem.prompt}],
        max_tokens=arith.ANSWER_MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.content is not None
    pd_cluster.wait_drained()


def test_transfer_counters_match_the_prompt(pd_cluster: Cluster) -> None:
    before = pd_cluster.load("decode-0")
    problem = arith.make_problems(1, seed=5)[0]
    r = httpx.post(
        f"{pd_cluster.url}/v1/completions",
        json={"model": MODEL.name, "prompt": problem.prompt, "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    num_prompt = r.json()["usage"]["prompt_tokens"]
    after = pd_cluster.wait_drained()["decode-0"]
    info_pages = -(-num_prompt // 16)  # configs/tiny-1p1d.yaml: page_size 16
    assert after.transfer_pages - before.transfer_pages == info_pages
    assert after.transfer_bytes - before.transfer_bytes > 0
    assert (after.transfer_bytes - before.transfer_bytes) % info_pages == 0


def test_client_disconnect_mid_stream_frees_everything(pd_cluster: Cluster) -> None:
    body = {
        "model": MODEL.name,
        "prompt": "a=1;" * 30,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    for _ in range(3):
        with httpx.stream("POST", f"{pd_cluster.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:") and '"text"' in line:
                    break  # got a token: leave mid-stream
    pd_cluster.wait_drained()


def test_client_timeout_before_first_token_frees_everything(pd_cluster: Cluster) -> None:
    # A short prompt and the longest answer the model's 512 positions allow: the request runs
    # ~2 s, so a client stalled by a loaded machine cannot wake to find the answer complete
    # (450 tokens in 0.37 s once did exactly that on CI).
    body = {"model": MODEL.name, "prompt": "b=2;" * 10, "max_tokens": 440, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{pd_cluster.url}/v1/completions", json=body, timeout=0.005)
    pd_cluster.wait_drained()


def test_logprobs_cross_the_room(pd_cluster: Cluster) -> None:
    """The first token's logprobs are computed on prefill and travel with the room."""
    client = openai.OpenAI(base_url=f"{pd_cluster.url}/v1", api_key="unused")
    problem = arith.make_problems(1, seed=9)[0]
    out = client.completions.create(
        model=MODEL.name, prompt=problem.prompt, max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v is not None and v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    pd_cluster.wait_drained()


def test_any_hf_checkpoint_serves_1p1d_with_model_flag(tmp_path: Path) -> None:
    """`tandem serve --model DIR` (the default 1P1D config) serves a checkpoint nobody trained here.
    """
    import shutil

    from tests.worker.conftest import build_tiny_checkpoint

    ckpt = tmp_path / "tiny-llama"
    build_tiny_checkpoint(ckpt, "llama", vocab_size=128, max_position_embeddings=256)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, ckpt / name)
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path, model=ckpt) as c:
        r = httpx.post(
            f"{c.url}/v1/completions",
            json={
                "model": "tiny-llama",
                "prompt": "hello world",
                "max_tokens": 6,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        assert c.wait_drained()["decode-0"].transfer_pages > 0
