"""1P1D end to end: PD answers exactly what mono answers, with each transfer backend, passes the
CI gate, and leaves nothing behind (pages, rooms) whatever the client does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, REPO, Cluster, running_cluster
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


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pd_cluster(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The default 1P1D cluster with each transfer backend, one per backend for the module:
    the comparison with mono, the CI gate and the client drills share it (pytest runs every
    test of one backend before it starts the next)."""
    with running_cluster("configs/tiny-1p1d.yaml", f"transfer.backend={request.param}",
                         tmp=tmp_path_factory.mktemp(f"pd-{request.param}"), model=MODEL) as c:
        yield c


# The client drills run on the default backend's cluster (mooncake, the config's own).
default_backend = pytest.mark.parametrize("pd_cluster", ["mooncake"], indirect=True)


def test_pd_equals_mono_token_for_token(mono_outputs: list[str], pd_cluster: Cluster,
                                        prompts: list[str]) -> None:
    before = {name: pd_cluster.load(name) for name in pd_cluster.workers}
    pd_outputs = asyncio.run(complete_all(pd_cluster.url, prompts, arith.ANSWER_MAX_TOKENS))
    after = pd_cluster.wait_drained()
    mismatches = [
        (i, m, p) for i, (m, p) in enumerate(zip(mono_outputs, pd_outputs, strict=True)) if m != p
    ]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} differ, first: {mismatches[:3]}"

    def grown(name: str, counter: str) -> int:
        """What these prompts added to a cumulative counter (the cluster is shared)."""
        return int(getattr(after[name], counter)) - int(getattr(before[name], counter))

    assert grown("decode-0", "prompt_tokens_computed") == 0, "decode ran prompt tokens"
    assert grown("prefill-0", "transfer_pages") == grown("decode-0", "transfer_pages") > 0
    assert grown("prefill-0", "transfer_bytes") == grown("decode-0", "transfer_bytes") > 0


def run_gate(url: str, samples: int = 100) -> subprocess.CompletedProcess[str]:
    """`tandem eval --task arith` at the CI bar (0.90)."""
    argv = [sys.executable, "-m", "orchestrator.cli", "eval", "--url", url, "--task", "arith",
            "--samples", str(samples), "--concurrency", "8", "--min-accuracy", "0.90"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def test_gate_passes_on_1p1d(pd_cluster: Cluster) -> None:
    """The CI gate: the default 1P1D cluster answers the `arith` task correctly with each
    transfer backend (tests/e2e/test_gate.py: the same gate fails on corrupted pages)."""
    gate = run_gate(pd_cluster.url)
    pd_cluster.wait_drained()
    assert gate.returncode == 0, gate.stdout + gate.stderr
    assert "accuracy: " in gate.stdout


@default_backend
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


@default_backend
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


@default_backend
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


@default_backend
def test_client_timeout_before_first_token_frees_everything(pd_cluster: Cluster) -> None:
    # A short prompt and the longest answer the model's 512 positions allow: the request runs
    # ~2 s, so a client stalled by a loaded machine cannot wake to find the answer complete
    # (450 tokens in 0.37 s once did exactly that on CI).
    body = {"model": MODEL.name, "prompt": "b=2;" * 10, "max_tokens": 440, "ignore_eos": True}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{pd_cluster.url}/v1/completions", json=body, timeout=0.005)
    pd_cluster.wait_drained()


@default_backend
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
