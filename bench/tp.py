"""Step time of one worker at TP=1 vs TP=2 (MoE TP / EP=2, attention DP=2) on CPU,
real gloo process groups.

    python -m bench.tp

Builds tiny random checkpoints (dense Qwen3, a wider dense Qwen3, a Qwen3-MoE) in a temporary
directory and times, per layout, a 512-token prefill step and the mean step of a 65-token
greedy generation at batch 8. Figures: docs/parallelism.md.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from models.make_tiny_moe import make_tiny_moe
from tests.worker.conftest import build_tiny_checkpoint
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine


def bench(name: str, path: Path, tp: int, ep: int = 1, dp: int = 1) -> None:
    engine = Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=16, num_pages=512),
            scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=512),
            parallel=ParallelConfig(tp_size=tp, ep_size=ep, dp_size=dp),
            num_threads=1,
        )
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(97) for _ in range(64)] for _ in range(8)]
    generate(engine, prompts, max_tokens=4)  # warm-up
    t0, n0 = time.perf_counter(), engine.num_steps
    generate(engine, [[rng.randrange(97) for _ in range(64)] for _ in range(8)], max_tokens=1)
    prefill = (time.perf_counter() - t0) / (engine.num_steps - n0)
    t0, n0 = time.perf_counter(), engine.num_steps
    generate(engine, prompts, max_tokens=65)
    seconds = time.perf_counter() - t0
    mean = seconds / (engine.num_steps - n0)
    print(
        f"{name} tp={tp} dp={dp} ep={ep}: prefill step {prefill * 1e3:.1f} ms, mean step "
        f"{mean * 1e3:.1f} ms, {len(prompts) * 65 / seconds:.0f} tok/s",
        flush=True,
    )
    engine.close()


def main() -> None:
    root = Path(tempfile.mkdtemp())
    build_tiny_checkpoint(root / "tiny", "qwen3", max_position_embeddings=256)
    build_tiny_checkpoint(
        root / "wide",
        "qwen3",
        max_position_embeddings=256,
        hidden_size=512,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=4,
        vocab_size=4096,
    )
    make_tiny_moe(root / "moe", max_position_embeddings=256)
    for name in ("tiny", "wide"):
        bench(name, root / name, 1)
        bench(name, root / name, 2)
    bench("moe", root / "moe", 1)
    bench("moe", root / "moe", 2, ep=1)
    bench("moe", root / "moe", 2, ep=2)
    bench(
        "wide", root / "wide", 1, dp=2
    )  # two replicas behind one scheduler front: 4 sequences each
    bench("moe", root / "moe", 1, dp=2, ep=2)  # DP attention + EP: the DeepSeek-style layout
    bench("moe", root / "moe", 1, dp=2, ep=1)  # DP attention + MoE TP


if __name__ == "__main__":  # spawned ranks re-import this module
    main()
