"""FP8 KV cache through prefill/decode (`cache.kv_cache_dtype: fp8_e4m3`, the embedded model):
the 1P1D cluster passes the arith gate, its rooms ship one byte per KV element (a quarter of
float32 pages), and PD answers exactly what a mono worker with FP8 pages answers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, REPO, Cluster, running_cluster
from orchestrator.tasks import arith
from tests.e2e.test_pd import complete_all

FP8_KV = "cache.kv_cache_dtype=fp8_e4m3"
NUM_PROMPTS = 100
# configs/tiny-1p1d.yaml + the embedded model: 4 layers x K,V x 2 kv heads x 16 tokens x 32 dims.
ELEMENTS_PER_PAGE = 4 * 2 * 2 * 16 * 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in arith.make_problems(NUM_PROMPTS, seed=17)]


@pytest.fixture(scope="module")
def fp8_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        "configs/tiny-1p1d.yaml", FP8_KV, tmp=tmp_path_factory.mktemp("fp8-pd")
    ) as c:
        yield c


def test_fp8_kv_1p1d_passes_the_arith_gate(fp8_pd: Cluster) -> None:
    argv = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "eval",
        "--url",
        fp8_pd.url,
        "--task",
        "arith",
        "--samples",
        "100",
        "--concurrency",
        "8",
        "--min-accuracy",
        "0.90",
    ]
    gate = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    fp8_pd.wait_drained()
    assert gate.returncode == 0, gate.stdout + gate.stderr
    print(gate.stdout.strip())
    for role in (
        "prefill-0",
        "decode-0",
    ):  # the start-up line says what the pages are and which scales
        assert "KV float8_e4m3fn, K/V scales 1.0" in fp8_pd.log(role)


def test_fp8_rooms_ship_one_byte_per_kv_element(fp8_pd: Cluster) -> None:
    before = fp8_pd.wait_drained()
    problem = arith.make_problems(1, seed=23)[0]
    r = httpx.post(
        f"{fp8_pd.url}/v1/completions",
        json={
            "model": EMBEDDED_MODEL.name,
            "prompt": problem.prompt,
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    pages = -(-r.json()["usage"]["prompt_tokens"] // 16)
    after = fp8_pd.wait_drained()
    for role in ("prefill-0", "decode-0"):
        assert after[role].transfer_pages - before[role].transfer_pages == pages
        # one byte per element: a quarter of the 4-byte float32 pages the default cluster ships
        assert after[role].transfer_bytes - before[role].transfer_bytes == pages * ELEMENTS_PER_PAGE


def test_fp8_kv_pd_equals_fp8_kv_mono_token_for_token(
    fp8_pd: Cluster, prompts: list[str], tmp_path: Path
) -> None:
    with running_cluster("configs/tiny-mono.yaml", FP8_KV, tmp=tmp_path) as mono:
        mono_out = asyncio.run(complete_all(mono.url, prompts, arith.ANSWER_MAX_TOKENS))
        mono.wait_drained()
    pd_out = asyncio.run(complete_all(fp8_pd.url, prompts, arith.ANSWER_MAX_TOKENS))
    loads = fp8_pd.wait_drained()
    diffs = [(i, m, p) for i, (m, p) in enumerate(zip(mono_out, pd_out, strict=True)) if m != p]
    assert not diffs, f"{len(diffs)} of {len(prompts)} differ, first: {diffs[:3]}"
    assert loads["decode-0"].prompt_tokens_computed == 0, (
        "decode ran prompt tokens through the model"
    )
