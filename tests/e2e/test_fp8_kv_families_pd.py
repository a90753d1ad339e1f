"""FP8 KV pages (`--kv-cache-dtype fp8_e4m3`) through `tandem serve` 1P1D for the families
whose cache is not plain K/V pages: DeepSeek-V3 (MLA latent rows), GPT-OSS (sliding-window
rings with attention sinks) and Qwen3-Next (recurrent state beside full-attention pages). For
each, PD answers token for token what one engine with FP8 pages answers, and the cluster
drains. (test_fp8_pd.py covers the dense embedded model; the families' own PD tests run float32
pages.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import running_cluster
from tests.worker.deepseek_model import build_deepseek_checkpoint
from tests.worker.gpt_oss_model import build_gpt_oss_checkpoint
from tests.worker.qwen3_next_model import build_qwen3_next_checkpoint
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine

pytestmark = pytest.mark.slow
FP8_KV = "cache.kv_cache_dtype=fp8_e4m3"
MAX_TOKENS = 12
FAMILIES: dict[str, Callable[[Path], object]] = {
    "deepseek-v3-mla": lambda p: build_deepseek_checkpoint(p, seed=11),
    "gpt-oss-window-sinks": lambda p: build_gpt_oss_checkpoint(p, seed=11),
    "qwen3-next-state": lambda p: build_qwen3_next_checkpoint(p, seed=11),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(8)  # one page, several pages, past GPT-OSS's window (8), past a chunk
    return [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 23, 45, 70)]


def _mono_fp8(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """One engine with FP8 pages at configs/tiny-1p1d.yaml's page and chunk sizes, one request
    at a time (as the PD requests below are sent)."""
    engine = Engine(WorkerConfig(
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(page_size=16, num_pages=256, kv_cache_dtype="fp8_e4m3"),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=512), num_threads=1))
    outs = [generate(engine, [p], max_tokens=MAX_TOKENS)[0] for p in prompts]
    engine.scheduler.assert_drained()
    return outs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_pages_pd_equals_mono(tmp_path: Path, family: str) -> None:
    path = tmp_path / family
    FAMILIES[family](path)
    prompts = _prompts()
    want = _mono_fp8(path, prompts)
    with running_cluster("configs/tiny-1p1d.yaml", f"model.path={path}", FP8_KV, tmp=tmp_path,
                         model=path) as cluster:
        got = []
        for p in prompts:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=60, json={
                "model": family, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        cluster.wait_drained()
        assert "float8_e4m3fn" in cluster.log("decode-0")
    assert got == want
