"""Qwen3-Next served whole: the recurrent-state group end to end.

- mono engine: greedy = transformers' `generate`, with prompts longer than a chunk, a repeated
  prompt and prompts sharing a prefix (a prefix hit restores the state snapshot taken at the
  prompt's last page boundary: fewer prompt tokens run), every page and state slot freed;
- `tandem serve --model DIR --dtype float32` 1P1D (the acceptance path, token-id prompts): the
  completion equals transformers', prefill ships the state slot (decode runs no prompt token:
  the state it decodes from is prefill's), the transfer counters carry the slot's bytes, and the
  cluster drains;
- a Qwen3-Next of linear_attention layers only (no K/V page holds a byte; transformers writes
  such a config) 1P1D: the state slot alone travels and the tokens equal transformers' (the
  prefill refused every registration, dividing the registered bytes by a page of 0 bytes).
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from orchestrator.launch.background import running_cluster
from tests.worker.qwen3_next_model import build_qwen3_next_checkpoint
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, eos included (ignore_eos; generate's min_new_tokens would
    ban eos instead): the argmax of a full forward per step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            # no cache: transformers' cache cannot build a mask without an attention layer
            logits = hf(torch.tensor([ids]), use_cache=False).logits  # [1, S, V]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    first = [rng.randrange(3, 128) for _ in range(45)]
    return [first, list(first), first[:36] + [rng.randrange(3, 128) for _ in range(9)]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("q3n") / "tiny-qwen3-next"
    return path, build_qwen3_next_checkpoint(path)


def test_mono_engine_equals_transformers_and_prefix_hits_restore_the_state(
        ckpt: tuple[Path, torch.nn.Module]) -> None:
    path, hf = ckpt
    engine = Engine(WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=4, num_pages=256),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16)))
    computed = []
    for i, prompt in enumerate(_prompts(3)):
        out: list[int] = []
        cached: list[int] = []

        def sink(o: RequestOutput, out: list[int] = out, cached: list[int] = cached) -> None:
            out.extend(o.token_ids)
            if o.num_prompt_tokens:
                cached.append(o.num_cached_tokens)

        before = engine.scheduler.prompt_tokens_computed
        engine.submit(Request(f"q{i}", prompt, SamplingParams(temperature=0.0,
                                                              max_tokens=MAX_TOKENS,
                                                              ignore_eos=True)), sink)
        while engine.step() or engine.has_pending_work():
            pass
        assert out == _greedy(hf, prompt, MAX_TOKENS), f"prompt {i}"
        computed.append(engine.scheduler.prompt_tokens_computed - before)
        engine.scheduler.assert_drained()
    # 45 tokens, pages of 4: the snapshot sits at 44; the repeat restores it, the third prompt
    # shares 36 tokens (a snapshot only at 44: no restore point, so it runs whole).
    assert computed == [45, 1, 45]


def test_tandem_serve_model_flag_serves_qwen3_next_1p1d_like_transformers(
        ckpt: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    path, hf = ckpt
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    overrides = ("model.dtype=float32", "scheduler.chunked_prefill_size=32")  # 45 tokens: 2 chunks
    with running_cluster("configs/tiny-1p1d.yaml", *overrides, tmp=tmp_path, model=path) as c:
        for prompt, cached in zip(_prompts(5), (0, 32, 32), strict=True):  # snapshots at 32
            r = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
                "model": path.name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True,
            })
            assert r.status_code == 200, r.text
            body = r.json()
            want = tok.decode(_greedy(hf, prompt, MAX_TOKENS), skip_special_tokens=True)
            assert body["choices"][0]["text"] == want
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        loads = c.wait_drained()
    prefill, decode = loads["prefill-0"], loads["decode-0"]
    assert decode.prompt_tokens_computed == 0, "decode ran prompt tokens: it must land the state"
    assert prefill.transfer_bytes == decode.transfer_bytes > 0
    assert all(load.kv_used_pages == 0 for load in loads.values())


def test_linear_attention_only_qwen3_next_serves_1p1d_like_transformers(tmp_path: Path) -> None:
    path = tmp_path / "qwen3-next-linear-only"
    hf = build_qwen3_next_checkpoint(path, seed=23, layer_types=["linear_attention"] * 4)
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (6, 41)]
    with running_cluster("configs/tiny-1p1d.yaml", "model.dtype=float32", tmp=tmp_path,
                         model=path) as c:
        for prompt in prompts:
            r = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
                "model": path.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == _greedy(hf, prompt, MAX_TOKENS)
        loads = c.wait_drained()
    assert loads["decode-0"].prompt_tokens_computed == 0, "decode must land prefill's state"
    assert loads["prefill-0"].transfer_bytes == loads["decode-0"].transfer_bytes > 0
