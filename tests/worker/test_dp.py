"""Attention DP in the engine, for real (gloo, spawned rank processes).

A worker with dp_size=2 runs two schedulers on rank 0, each over its group's own KV pages;
every step carries both groups' batches (an idle group runs an empty one, which must still
join the MoE all-to-all). Greedy tokens must equal a one-rank engine's, both groups must have
served requests, and every page must come back. (PD workers with DP: tests/e2e/test_hetero_tp.py.)
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from models.make_tiny_moe import make_tiny_moe
from tests.worker.test_engine import generate
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.distributed import empty_batch, pack_batch, pack_batches, unpack_group_batch
from worker.engine import Engine


def _engine(path: Path, dp: int, ep: int = 1) -> Engine:
    return Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=96),
            scheduler=SchedulerConfig(
                max_num_seqs=4, chunked_prefill_size=16
            ),  # prompts span several chunks
            parallel=ParallelConfig(dp_size=dp, ep_size=ep),
            num_threads=1,
        )
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _check_dp_engine(path: Path, ep: int) -> None:
    prompts = _prompts(7, seed=3)
    want = generate(_engine(path, dp=1), prompts, max_tokens=6)
    eng = _engine(path, dp=2, ep=ep)
    try:
        assert eng.dp is not None and len(eng.schedulers) == 2
        # One request alone: group 1 idles through every step (an empty batch on rank 1).
        assert generate(eng, prompts[:1], max_tokens=6) == want[:1]
        served = [s.prompt_tokens_computed for s in eng.schedulers]
        assert generate(eng, prompts, max_tokens=6) == want
        after = [s.prompt_tokens_computed for s in eng.schedulers]
        assert after[0] > served[0] and after[1] > served[1], "both DP groups served requests"
        for sched in eng.schedulers:
            assert not sched.running and not sched.waiting and sched.stats().used_pages == 0
            sched.assert_drained()
        assert not eng._group, "every request's group was forgotten when it finished"
    finally:
        eng.close()
    assert eng.tp is not None and all(not p.is_alive() for p in eng.tp.procs)


def test_moe_dp2_ep2_engine_equals_one_rank(tmp_path: Path) -> None:
    """DP attention with expert parallelism over both groups (the DeepSeek-style layout)."""
    make_tiny_moe(tmp_path / "moe")
    _check_dp_engine(tmp_path / "moe", ep=2)


def test_moe_dp2_with_moe_tp_engine_equals_one_rank(tmp_path: Path) -> None:
    """DP attention with TP-sharded experts: tokens gathered from both groups, features split."""
    make_tiny_moe(tmp_path / "moe")
    _check_dp_engine(tmp_path / "moe", ep=1)


def test_dense_dp2_engine_equals_one_rank(tiny_checkpoint) -> None:
    """A dense model: two independent replicas behind one scheduler front
    (no collective crosses groups)."""
    path, _ = tiny_checkpoint("qwen3")
    _check_dp_engine(path, ep=1)


def test_dp_batches_pack_per_group(tiny_checkpoint) -> None:
    from worker.batch import ForwardBatch

    one = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 2]),
        query_start=torch.tensor([0, 3]),
        seq_lens=torch.tensor([3]),
        page_table=torch.tensor([[4]]),
        slot_mapping=torch.tensor([16, 17, 18]),
        logits_indices=torch.tensor([2]),
        query_start_list=[0, 3],
        seq_lens_list=[3],
    )
    idle = empty_batch(torch.device("cpu"))
    flat = pack_batches([idle, one, idle])
    for group, want in enumerate([idle, one, idle]):
        got = unpack_group_batch(flat, group, torch.device("cpu"))
        assert torch.equal(pack_batch(got), pack_batch(want))
    assert unpack_group_batch(flat, 1, torch.device("cpu")).seq_lens_list == [3]
    assert unpack_group_batch(flat, 0, torch.device("cpu")).num_tokens == 0


def test_a_dp_worker_reports_each_groups_load() -> None:
    """GetLoad's dp_groups: one entry per scheduler, in group order (the gateway balances a
    prefill worker's groups with them); a worker without DP sends none."""
    from types import SimpleNamespace

    from tests.worker.factories import make_request, make_scheduler
    from worker.server import WorkerService

    scheds = [make_scheduler(num_pages=16)[0], make_scheduler(num_pages=32)[0]]
    scheds[1].add(make_request(5))
    service = WorkerService(WorkerConfig())
    service.engine = SimpleNamespace(schedulers=scheds, drafter=None, hooks=None,  # type: ignore[assignment]
                                     spec_counters=None)
    load = service.load()
    assert [(g.waiting, g.kv_total_pages) for g in load.dp_groups] == [(0, 16), (1, 32)]
    assert [g.prompt_tokens_computed for g in load.dp_groups] == [0, 0]
    assert load.waiting == 1 and load.kv_total_pages == 48
    service.engine.schedulers = scheds[:1]  # type: ignore[union-attr]
    assert not service.load().dp_groups
