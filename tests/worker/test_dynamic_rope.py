"""Dynamic NTK RoPE (`rope_type: dynamic`) served like transformers, in every family that takes it.

Its base grows with the sequence's length past max_position_embeddings, so a token's rotation
depends on how long its request is (worker/model/rope.py). Regressions found by the sweep of
transformers-written checkpoints:

- Qwen3-Next with dynamic RoPE loaded, then failed every request at its first step with an
  internal error ("dynamic NTK RoPE needs each token's request length"): its forward did not
  pass the lengths, as Llama's and DeepSeek's do (all three now take cos/sin from the batch;
  the prompt must also run in one pass, as it does without the prefix cache: see below);
- a prefix-cache hit reused keys rotated with the base of the request that computed them: a
  prompt past max_position_embeddings that shared pages with an earlier, shorter one got other
  logits than the same prompt served cold (|diff| 0.75 on a tiny Llama). Dynamic RoPE models
  now run without the prefix cache;
- a prompt past max_position_embeddings prefilled in chunks: each chunk took the length reached
  so far, transformers the whole prompt's (logits off by ~9 with chunks of 8). The runner now
  gives the model each request's prompt length (ForwardBatch.prompt_lens_list).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tests.worker.qwen3_next_model import build_qwen3_next_checkpoint
from tests.worker.test_arch_variants import build, engine_vs_transformers
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine

# max_position_embeddings 24, so prompts of 23 and 41 tokens (and their decodes) scale the base;
# factor 4 makes the served context 96, room for the longest prompt and its tokens
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


def test_qwen3_next_with_dynamic_rope_serves_like_transformers(tmp_path: Path) -> None:
    build_qwen3_next_checkpoint(tmp_path, max_position_embeddings=24,
                                rope_parameters={**DYNAMIC, "partial_rotary_factor": 0.25})
    ours, theirs, worst = engine_vs_transformers(tmp_path)
    assert worst < 1e-4, f"max |logit diff| {worst}"
    assert ours == theirs


def _last_prompt_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    rows: list[torch.Tensor] = []
    compute_logits = engine.model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(compute_logits(hidden).float())
        return rows[-1]

    engine.model.compute_logits = recorded  # type: ignore[method-assign]
    generate(engine, [prompt], max_tokens=1)
    engine.model.compute_logits = compute_logits  # type: ignore[method-assign]
    return rows[0][-1]  # [V]: after the prompt's last token


def test_a_prompt_past_max_positions_is_served_alike_after_a_shorter_one_shared_its_pages(
        tmp_path: Path) -> None:
    """The first 16 tokens of `long` were computed (base unscaled) by `short`, 20 tokens; served
    cold, `long` (30 tokens) rotates every token with the base for length 30, as transformers."""
    path = build(tmp_path, "llama", {"max_position_embeddings": 24, "rope_parameters": DYNAMIC})

    def engine() -> Engine:
        return Engine(WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=64),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=256), num_threads=1))

    rng = random.Random(1)
    short = [rng.randrange(3, 97) for _ in range(20)]
    long = short[:16] + [rng.randrange(3, 97) for _ in range(14)]
    cold = _last_prompt_logits(engine(), long)
    warm_engine = engine()
    generate(warm_engine, [short], max_tokens=4)
    warm = _last_prompt_logits(warm_engine, long)
    warm_engine.scheduler.assert_drained()
    assert float((warm - cold).abs().max()) < 1e-5


def test_a_prompt_past_max_positions_prefilled_in_chunks_is_served_like_transformers(
        tmp_path: Path) -> None:
    """Chunks of 8: each chunk's tokens take the whole prompt's length (transformers' one-pass
    prefill), decodes their own; before, each chunk took the length it had reached."""
    path = build(tmp_path, "llama", {"max_position_embeddings": 24, "rope_parameters": DYNAMIC})
    ours, theirs, worst = engine_vs_transformers(path, lens=(23, 41), chunk=8)
    assert worst < 1e-4, f"max |logit diff| {worst}"
    assert ours == theirs
