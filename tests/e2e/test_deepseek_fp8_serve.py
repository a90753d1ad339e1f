"""`tandem serve` with a DeepSeek-V3 checkpoint in DeepSeek's FP8 format, mono and 1P1D, on CPU.

The tiny random DeepSeek-V3 of tests/worker/deepseek_model.py (MLA with q_lora, MoE with
grouped routing and a shared expert, an MTP layer) made FP8 by models/make_fp8.py with 16x32
blocks; the CPU workers dequantize it at load. Token-id prompts (one longer than two chunks),
greedy, `return_token_ids`:

- model KV dtype: mono's tokens equal transformers' `generate` on the dequantized weights
  (float32), and 1P1D's equal mono's;
- `--kv-cache-dtype fp8_e4m3` (latent pages in e4m3): 1P1D's tokens equal mono's, the rooms
  ship one byte per latent element, and most tokens still equal transformers' (the rate is
  printed; e4m3 pages round each latent to 3 mantissa bits).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch

from orchestrator.launch.background import running_cluster
from tests.worker.deepseek_model import CONFIG, LATENT_DIM, build_deepseek_fp8_checkpoint

pytestmark = pytest.mark.slow
MAX_TOKENS, PAGE = 8, 16
OVERRIDES = ("model.dtype=float32", "scheduler.chunked_prefill_size=32")  # 70 tokens: 3 chunks


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(the FP8 checkpoint, transformers' greedy tokens for PROMPTS on its dequantized weights)."""
    path = tmp_path_factory.mktemp("deepseek-fp8") / "tiny-deepseek-v3-fp8"
    hf = build_deepseek_fp8_checkpoint(path, block=(16, 32), mtp=True)
    want = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS, do_sample=False)
        want.append(out[0, len(prompt) :].tolist())
    return path, want


_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 128) for _ in range(n)] for n in (70, 21, 9)]


def _serve(config: str, path: Path, tmp: Path, *extra: str) -> tuple[list[list[int]], dict]:
    """Greedy tokens for PROMPTS from a `tandem serve` cluster, and its drained loads."""
    got = []
    tmp.mkdir()
    with running_cluster(config, *OVERRIDES, *extra, tmp=tmp, model=path) as c:
        for prompt in PROMPTS:
            r = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
                "model": path.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            })
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        loads = c.wait_drained()
        log = "".join(c.log(name) for name in c.workers)
    assert "FP8 block-scaled checkpoint: weights dequantized at load" in log
    return got, loads


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_fp8_deepseek_serves_mono_and_1p1d_like_transformers(
    kv: str, fp8_model: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    path, want = fp8_model
    kv_flag = f"cache.kv_cache_dtype={kv}"
    mono, _ = _serve("configs/tiny-mono.yaml", path, tmp_path / "mono", kv_flag)
    pd, loads = _serve("configs/tiny-1p1d.yaml", path, tmp_path / "pd", kv_flag)
    assert pd == mono, f"kv {kv}: 1P1D differs from mono"
    pages = sum(-(-len(p) // PAGE) for p in PROMPTS)
    assert loads["decode-0"].transfer_pages == pages
    element = 4 if kv == "auto" else 1  # float32 latents, or e4m3
    per_page = CONFIG["num_hidden_layers"] * PAGE * LATENT_DIM * element
    assert loads["decode-0"].transfer_bytes == pages * per_page
    same = sum(a == b for g, w in zip(mono, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"kv {kv}: {same}/{len(PROMPTS) * MAX_TOKENS} tokens equal transformers'")
    if kv == "auto":
        assert mono == want
    else:
        assert same >= len(PROMPTS) * MAX_TOKENS // 2
