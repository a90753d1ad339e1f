"""The context a RoPE-scaled checkpoint serves: max_position_embeddings extended by its scaling
factor, as vLLM derives max_model_len (linear / dynamic: max_position_embeddings x factor; YaRN:
original_max_position_embeddings x factor; llama3's max_position_embeddings already counts its
extension). Before, every checkpoint was capped at max_position_embeddings: a Qwen config given
YaRN for long context (the model card's recipe) kept its short limit, and dynamic NTK never
scaled (its base grows only past max_position_embeddings)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.test_arch_variants import TINY, build
from tests.worker.test_engine import generate
from worker.arch.hf_config import context_limit, parse_arch_config
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 1e4}
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 32),
    "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
               64),
    "dynamic-old-spelling": ({"rope_theta": 1e4, "rope_scaling": {"type": "dynamic",
                                                                  "factor": 3.0}}, 96),
    "yarn": ({"rope_parameters": YARN}, 128),
    "yarn-original-shorter": ({"rope_parameters": {**YARN, "original_max_position_embeddings": 16}},
                              64),
    "yarn-extension-already-counted": ({"rope_parameters": {**YARN, "factor": 2.0,
                                        "original_max_position_embeddings": 8}}, 32),
    "llama3": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 4}}, 32),
    # transformers: a top-level original_max_position_embeddings outranks the nested one
    "yarn-original-top-level": ({"rope_parameters": YARN, "original_max_position_embeddings": 16},
                                64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_context_limit_follows_the_rope_scaling(case: str) -> None:
    fields, want = CASES[case]
    cfg = {**TINY, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 32, **fields}
    assert context_limit(cfg) == want
    assert parse_arch_config(cfg).context_limit == want  # the worker's reading agrees


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}


@pytest.mark.parametrize(("rope", "limit", "n"), [(YARN, 128, 70), (DYNAMIC, 64, 45)],
                         ids=["yarn", "dynamic"])
def test_scaled_checkpoint_serves_past_max_position_embeddings(
        tmp_path: Path, rope: dict[str, Any], limit: int, n: int) -> None:
    """A prompt past max_position_embeddings (32) runs, and its greedy tokens are
    transformers'. (Dynamic NTK: transformers' model keeps its grown base across calls, so it
    is loaded fresh for the one prompt; the prompt is one prefill chunk, see rope.py.)"""
    import transformers

    path = build(tmp_path, "llama", {"max_position_embeddings": 32, "rope_parameters": rope})
    engine = Engine(WorkerConfig(model=ModelConfig(path=str(path), dtype="float32"),
                                 cache=CacheConfig(page_size=4, num_pages=64), num_threads=1))
    assert engine.max_model_len == limit
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [random.Random(6).randrange(3, 97) for _ in range(n)]
    ours = generate(engine, [prompt], max_tokens=12)[0]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs
    engine.scheduler.assert_drained()
