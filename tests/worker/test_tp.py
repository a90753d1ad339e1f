"""Tensor parallelism for real: gloo process groups on CPU, two rank processes.

- model level: vocab-parallel embedding and LM head (odd vocabulary, tied and untied) and
  kv heads replicated when TP > kv heads give transformers' logits on every rank;
- engine level: a TP=2 engine (rank 0 here, rank 1 spawned by the engine itself) produces
  the TP=1 engine's greedy tokens, and its logits are within tolerance;
- the step channel's packing round-trips a batch and room ids of all 64 bits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.distributed import from_i64, pack_batch, to_i64, unpack_batch
from worker.engine import Engine
from worker.model import load_model
from worker.model.layers import kv_heads_per_rank
from worker.model.weights import WeightShapeError
from worker.sampling import SamplingParams


def _model_rank(rank: int, path: str, init_file: str, out_dir: str, ids: list[int]) -> None:
    """One rank: load its shard (1 kv head over 2 ranks: replicated), prefill, decode; save logits.
    """
    import torch.distributed as dist

    from tests.worker.conftest import PagedHarness

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, spec = load_model(ModelConfig(path=path), ParallelConfig(tp_size=2, tp_rank=rank))
        assert (
            model.model.embed_tokens.weight.shape[0] == 49
        )  # ceil(97 / 2): this rank's vocab rows
        harness = PagedHarness(
            model, spec, tp_size=1
        )  # 1 kv head per rank (a replica), as kv_shape says
        rows = [harness.step([("r", ids[:9])]), harness.step([("r", ids[9:-2])])]
        rows += [harness.step([("r", [t])]) for t in ids[-2:]]
        torch.save(torch.cat(rows), f"{out_dir}/logits{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_and_replicated_kv_heads_match_transformers(
    tied: bool, tiny_checkpoint, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    path, hf = tiny_checkpoint(
        "qwen3", num_key_value_heads=1, tie_word_embeddings=tied
    )  # vocab 97: odd
    ids = [random.Random(5).randrange(97) for _ in range(18)]
    mp.spawn(_model_rank, args=(str(path), str(tmp_path / "init"), str(tmp_path), ids), nprocs=2)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0][[8, 15, 16, 17]]  # [4, V]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"logits{rank}.pt")
        assert got.shape == want.shape  # full vocabulary on every rank after the gather
        assert float((got - want).abs().max()) < 1e-4


def test_kv_heads_per_rank_rules() -> None:
    assert kv_heads_per_rank(4, 2) == 2
    assert kv_heads_per_rank(2, 4) == 1  # replicated
    with pytest.raises(WeightShapeError, match="multiple of num_kv_heads"):
        kv_heads_per_rank(2, 3)


def test_batch_packing_round_trips_and_room_ids_keep_64_bits(tiny_checkpoint) -> None:
    from worker.batch import ForwardBatch

    qs = [0, 3, 4]
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 8]),
        positions=torch.tensor([0, 1, 2, 9]),
        query_start=torch.tensor(qs),
        seq_lens=torch.tensor([3, 10]),
        page_table=torch.tensor([[4, 0, 0], [1, 2, 3]]),
        slot_mapping=torch.tensor([16, 17, 18, 13]),
        logits_indices=torch.tensor([2, 3]),
        query_start_list=qs,
        seq_lens_list=[3, 10],
    )
    back = unpack_batch(pack_batch(batch), torch.device("cpu"))
    for name in (
        "input_ids",
        "positions",
        "query_start",
        "seq_lens",
        "page_table",
        "slot_mapping",
        "logits_indices",
    ):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert back.query_start_list == qs and back.seq_lens_list == [3, 10]
    for room in (1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert from_i64(to_i64(room)) == room and -(1 << 63) <= to_i64(room) < 1 << 63


def _engine(path: Path, tp: int) -> Engine:
    return Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=128),
            scheduler=SchedulerConfig(
                max_num_seqs=8, chunked_prefill_size=16
            ),  # prompts span several chunks
            parallel=ParallelConfig(tp_size=tp),
            num_threads=1,
        )
    )


def test_engine_tp2_equals_tp1(tiny_checkpoint) -> None:
    """Greedy tokens equal, logits within tolerance; rank 1 is a real spawned process."""
    from tests.worker.test_engine import generate

    path, _ = tiny_checkpoint("qwen3")  # 2 kv heads: one per rank
    rng = random.Random(7)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (23, 9, 31)]
    ref_engine = _engine(path, 1)
    want = generate(ref_engine, prompts, max_tokens=8)
    eng = _engine(path, 2)
    try:
        assert eng.tp is not None and eng.tp.channel.world_size == 2
        got = generate(eng, prompts, max_tokens=8)
        assert got == want
        # Logits: one prefill step through both engines' runners.
        from worker.request import Request
        from worker.step import ScheduledChunk, SchedulePlan

        rows = []
        for e in (ref_engine, eng):
            req = Request(f"l{id(e)}", prompts[2], SamplingParams(max_tokens=1))
            pool = e.scheduler.cache.full.pool  # a page table by hand: no scheduler step
            req.page_table = pool.allocate(8, req.request_id)
            batch = e.runner.build_batch(
                SchedulePlan(chunks=[ScheduledChunk(req, 0, len(prompts[2]), True)])
            )
            with torch.inference_mode():
                rows.append(e.model.compute_logits(e.model(batch, e.kv)[batch.logits_indices]))
            pool.release(req.page_table, req.request_id)
        assert float((rows[0] - rows[1]).abs().max()) < 1e-4
    finally:
        eng.close()
    assert all(not p.is_alive() for p in eng.tp.procs)  # STOP reached the follower
