"""Attention DP and the prefix cache: each DP group has its own pages and prefix cache, so a
request must join the group that holds its prefix (an agent's next turn), not the one with the
most free pages, which is the other group once the first has cached the conversation.
(Prefill workers put room r in group r % dp_size, the rule decode relies on: not covered here.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams

PAGE = 4


def _engine(path: Path) -> Engine:
    return Engine(WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=PAGE, num_pages=96),
        scheduler=SchedulerConfig(max_num_seqs=4, chunked_prefill_size=16),
        parallel=ParallelConfig(dp_size=2),
        num_threads=1,
    ))


def _run(eng: Engine, prompts: list[list[int]]) -> list[int]:
    """Run `prompts` together; each one's reported cached tokens."""
    cached: dict[str, int] = {}
    done: set[str] = set()

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            assert out.finish_reason != "error", out.error
            if out.num_prompt_tokens:
                cached[rid] = out.num_cached_tokens
            if out.finished:
                done.add(rid)
        return sink

    rids = [f"p{len(eng._group)}-{i}-{id(p)}" for i, p in enumerate(prompts)]  # noqa: SLF001
    for rid, prompt in zip(rids, prompts, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        eng.submit(Request(rid, list(prompt), params), sink_for(rid))
    for _ in range(1000):
        if len(done) == len(rids):
            break
        eng.step()
    assert len(done) == len(rids)
    return [cached[r] for r in rids]


def test_a_conversation_turn_joins_the_dp_group_holding_its_prefix(
        tiny_checkpoint: Callable[..., tuple[Path, torch.nn.Module]]) -> None:
    path, _ = tiny_checkpoint("qwen3")
    eng = _engine(path)
    try:
        prompt = [(7 * i + 3) % 90 + 6 for i in range(30)]
        cached = []
        for turn in range(3):  # each turn: the last prompt and 7 tokens more
            cached += _run(eng, [prompt])
            prompt = prompt + [10 + turn] * 7
        # The whole previous prompt's full pages every time (before: 0, then 28 from two turns
        # back: the turns alternated between the groups).
        assert cached == [0, 28, 36]
        # Prompts that share a prefix, all at once: the group holding it takes them only while
        # it is not busier than the other by more than a quarter of max_num_seqs.
        shared = prompt[:20]
        before = [s.prompt_tokens_computed for s in eng.schedulers]
        _run(eng, [shared + [50 + i] * 9 for i in range(4)])
        after = [s.prompt_tokens_computed for s in eng.schedulers]
        assert after[0] > before[0] and after[1] > before[1], "both DP groups served requests"
        for sched in eng.schedulers:
            sched.assert_drained()
    finally:
        eng.close()
