"""`tandem serve --model DIR --dtype float32` serves a DeepSeek-V3 checkpoint 1P1D over HTTP.

The acceptance path: the default config (configs/tiny-1p1d.yaml: one prefill, one decode,
Mooncake over loopback, the gateway) with the tiny random DeepSeek-V3 of
tests/worker/deepseek_model.py (the embedded model's tokenizer copied in). Token-id prompts
longer than a chunk, then one sharing a long prefix with the first (a prefill prefix hit): the
completion text equals transformers' greedy `generate` decoded by the same tokenizer, usage counts
the cached tokens, decode computes no prompt token, and the cluster drains (no page used).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from orchestrator.launch.background import running_cluster
from tests.worker.deepseek_model import build_deepseek_checkpoint

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


def test_tandem_serve_model_flag_serves_deepseek_1p1d_like_transformers(tmp_path: Path) -> None:
    ckpt = tmp_path / "tiny-deepseek-v3"
    hf = build_deepseek_checkpoint(ckpt, mtp=True)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    rng = random.Random(11)
    first = [rng.randrange(3, 128) for _ in range(70)]
    second = first[:48] + [rng.randrange(3, 128) for _ in range(20)]  # shares 3 pages of 16
    overrides = ("model.dtype=float32", "scheduler.chunked_prefill_size=32")  # 70 tokens: 3 chunks
    with running_cluster("configs/tiny-1p1d.yaml", *overrides, tmp=tmp_path, model=ckpt) as c:
        for prompt, cached in ((first, 0), (second, 48)):
            r = httpx.post(
                f"{c.url}/v1/completions",
                timeout=120,
                json={
                    "model": ckpt.name,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            with torch.no_grad():
                ids = hf.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=MAX_TOKENS,
                    min_new_tokens=MAX_TOKENS,
                    do_sample=False,
                )[0, len(prompt) :].tolist()
            text = body["choices"][0]["text"]
            assert (
                text == tok.decode(ids, skip_special_tokens=True) and len(text) >= MAX_TOKENS // 2
            )
            usage = body["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), MAX_TOKENS)
            assert usage["prompt_tokens_details"]["cached_tokens"] == cached
        loads = c.wait_drained()
    assert loads["decode-0"].prompt_tokens_computed == 0, "decode ran prompt tokens"
    # Every page of both prompts went over (decode keeps no prefix cache): ceil(70/16) + ceil(68/16)
    assert loads["decode-0"].transfer_pages == loads["prefill-0"].transfer_pages == 5 + 5
    assert all(load.kv_used_pages == 0 for load in loads.values())
