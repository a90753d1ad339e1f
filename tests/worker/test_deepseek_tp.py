"""DeepSeek-V3 over two real ranks (gloo on CPU): MLA heads split, the latent replicated.

- model level, three layouts on two spawned processes: attention TP=2 with MoE TP (experts
  split by feature), attention TP=2 with EP=2 (experts split by id, all-to-all), and attention
  DP=2 with EP=2; every rank's logits equal transformers', and under TP both ranks hold the very
  same latent pages (which is why PD ships one copy of a page to each decode rank);
- engine level: a TP=2 engine (its second rank spawned by the engine) gives the TP=1 engine's
  greedy tokens, and drains.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.worker.deepseek_model import build_deepseek_checkpoint
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.model import load_model

SEQ = [random.Random(9).randrange(3, 128) for _ in range(21)]
pytestmark = pytest.mark.slow


def _run(path: str, par: ParallelConfig, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill in two chunks, decode three tokens: (logits [5, V], the latent pool)."""
    from tests.worker.test_deepseek import latent_harness

    model, spec = load_model(ModelConfig(path=path), par)
    harness = latent_harness(model, spec)
    rows = [harness.step([("r", seq[:9])]), harness.step([("r", seq[9:-3])])]
    rows += [harness.step([("r", [t])]) for t in seq[-3:]]
    return torch.cat(rows), harness.kv.data.clone()


def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        layouts = {
            "tp2-moe-tp": ParallelConfig(tp_size=2, tp_rank=rank, ep_size=1),
            "tp2-ep2": ParallelConfig(tp_size=2, tp_rank=rank, ep_size=2),
        }
        for name, par in layouts.items():
            torch.save(_run(path, par, SEQ), f"{out_dir}/{name}-{rank}.pt")
        # Attention DP: each rank its own sequence (same step count, so the all-to-alls pair up).
        seq = SEQ if rank == 0 else SEQ[::-1]
        par = ParallelConfig(tp_size=1, tp_rank=0, dp_size=2, ep_size=2)
        torch.save(_run(path, par, seq), f"{out_dir}/dp2-ep2-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp_ep_and_dp_layouts_match_transformers(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    path = tmp_path / "ckpt"
    hf = build_deepseek_checkpoint(path, tokenizer=False, num_attention_heads=4)  # 2 heads per rank
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    picks = [8, 17, 18, 19, 20]  # the rows the harness returned: chunk ends, then each decode

    def want(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0][picks]  # [5, V]

    for name in ("tp2-moe-tp", "tp2-ep2"):
        (l0, kv0), (l1, kv1) = (torch.load(tmp_path / f"{name}-{r}.pt") for r in (0, 1))
        for logits in (l0, l1):
            assert float((logits - want(SEQ)).abs().max()) < 1e-4, name
        assert torch.equal(kv0, kv1), f"{name}: the ranks' latent pages differ"
    for rank, seq in ((0, SEQ), (1, SEQ[::-1])):
        logits, _ = torch.load(tmp_path / f"dp2-ep2-{rank}.pt")
        assert float((logits - want(seq)).abs().max()) < 1e-4, f"dp2-ep2 rank {rank}"


def _engine(path: Path, tp: int, ep: int = 1) -> object:
    from worker.engine import Engine

    return Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=96),
            scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16),
            parallel=ParallelConfig(tp_size=tp, ep_size=ep),
            num_threads=1,
        )
    )


def test_engine_tp2_ep2_equals_tp1(tmp_path: Path) -> None:
    from tests.worker.test_engine import generate
    from worker.engine import Engine

    build_deepseek_checkpoint(tmp_path, tokenizer=False)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (23, 9, 31)]
    ref = _engine(tmp_path, 1)
    assert isinstance(ref, Engine)
    want = generate(ref, prompts, max_tokens=8)
    eng = _engine(tmp_path, 2, ep=2)
    assert isinstance(eng, Engine)
    try:
        assert eng.kv.shape.latent_dim == 40 and eng.kv.shape.num_kv_heads == 1
        assert generate(eng, prompts, max_tokens=8) == want
        eng.scheduler.assert_drained()
    finally:
        eng.close()
