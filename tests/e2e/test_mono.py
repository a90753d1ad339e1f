"""Monolithic serving (`tandem serve --config configs/tiny-mono.yaml`): the `openai` client,
stream and not; bad input gets OpenAI-shaped 4xx while serving goes on; and any HF-format
Llama / Qwen2 / Qwen3 checkpoint serves with `--model DIR` under its directory's name."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster
from orchestrator.tasks import arith

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mono(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        "configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("mono"), model=MODEL
    ) as c:
        yield c


def test_openai_client_stream_and_not(mono: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{mono.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [MODEL.name]
    problem = arith.make_problems(1, seed=21)[0]
    plain = client.completions.create(
        model=MODEL.name,
        prompt=problem.prompt,
        max_tokens=arith.ANSWER_MAX_TOKENS,
        temperature=0,
        stop=[arith.STOP],
    )
    assert arith.score(problem, plain.choices[0].text)
    chunks = list(
        client.chat.completions.create(
            model=MODEL.name,
            messages=[{"role": "user", "content": problem.prompt}],
            max_tokens=arith.ANSWER_MAX_TOKENS,
            temperature=0,
            stream=True,
            stop=[arith.STOP],
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert arith.score(problem, text)
    mono.wait_drained()


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b'{"model": "tandem-arith", "prompt": "a=1', 400, ""),  # malformed JSON
        ({"prompt": "a=1;", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "a=1;", "model": "no-such-model"}, 404, "no-such-model"),
        ({"prompt": "a=1;" * 400, "max_tokens": 16}, 400, "max_model_len"),
        ({"prompt": 12.5, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "a=1;", "temperature": "hot"}, 400, "temperature"),
    ],
)
def test_bad_input_is_a_4xx_and_serving_goes_on(
    mono: Cluster, body: object, status: int, fragment: str
) -> None:
    if isinstance(body, dict):
        body = {"model": MODEL.name, **body}
        r = httpx.post(f"{mono.url}/v1/completions", json=body, timeout=30)
    else:
        r = httpx.post(
            f"{mono.url}/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and fragment in error["message"]
    ok = httpx.post(
        f"{mono.url}/v1/completions",
        json={"model": MODEL.name, "prompt": "a=1;\na?", "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_any_hf_checkpoint_serves_with_model_flag(family: str, tmp_path: Path) -> None:
    from tests.worker.conftest import build_tiny_checkpoint

    ckpt = tmp_path / f"tiny-{family}"
    build_tiny_checkpoint(ckpt, family, vocab_size=128, max_position_embeddings=256)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
    ):  # any tokenizer covering the vocabulary
        shutil.copy(EMBEDDED_MODEL / name, ckpt / name)
    with running_cluster("configs/tiny-mono.yaml", tmp=tmp_path, model=ckpt) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == [ckpt.name]
        out = client.completions.create(
            model=ckpt.name,
            prompt="hello",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(
            model=ckpt.name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            temperature=0,
        )
        assert chat.usage.completion_tokens <= 3
        c.wait_drained()
