"""The engine end to end on CPU (no server): it serves what transformers computes, and a
request's greedy output does not depend on what else is in the batch."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams


def make_engine(
    path: Path,
    *,
    page_size: int = 4,
    chunk: int = 32,
    num_pages: int = 256,
    max_num_seqs: int = 16,
    prefix_cache: bool = True,
    mixed_step_tokens: int = 0,
) -> Engine:
    config = WorkerConfig(
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(
            page_size=page_size, num_pages=num_pages, enable_prefix_cache=prefix_cache
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, chunked_prefill_size=chunk,
                                  mixed_step_tokens=mixed_step_tokens),
    )
    return Engine(config)


def generate(
    engine: Engine, prompts: list[list[int]], max_tokens: int, **sampling: object
) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    done: set[str] = set()

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            assert out.finish_reason != "error", out.error
            outputs[rid].extend(out.token_ids)
            if out.finished:
                done.add(rid)

        return sink

    rids = []
    for i, prompt in enumerate(prompts):
        rid = f"g{i}-{random.random()}"
        outputs[rid] = []
        rids.append(rid)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
        engine.submit(Request(rid, prompt, params), sink_for(rid))
    for _ in range(10_000):
        if len(done) == len(rids):
            break
        engine.step()
    assert len(done) == len(rids)
    return [outputs[r] for r in rids]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from tests.worker.conftest import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("qwen3")
    model = build_tiny_checkpoint(path, "qwen3", max_position_embeddings=256)
    return path, model


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def test_engine_greedy_equals_transformers(qwen3_dir: tuple[Path, torch.nn.Module]) -> None:
    path, hf = qwen3_dir
    engine = make_engine(path, chunk=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (5, 23, 40)]
    ours = generate(engine, prompts, max_tokens=12)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 12)
    engine.scheduler.assert_drained()


def test_batch_invariance_with_chunked_prefill_and_prefix_hits(
    qwen3_dir: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = qwen3_dir
    rng = random.Random(1)
    shared = [rng.randrange(1, 97) for _ in range(20)]
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(1, 97) for _ in range(rng.randrange(1, 60))]
        for i in range(16)
    ]
    alone_engine = make_engine(path, chunk=64, prefix_cache=False)
    alone = [generate(alone_engine, [p], max_tokens=10)[0] for p in prompts]
    batched_engine = make_engine(path, chunk=24)  # forces chunked prefill across steps
    generate(
        batched_engine, [prompts[0]], max_tokens=2
    )  # warms the prefix cache with the shared prefix
    batched = generate(batched_engine, prompts, max_tokens=10)
    assert batched == alone
    assert batched_engine.scheduler.stats().cached_pages > 0
    alone_engine.scheduler.assert_drained()
    batched_engine.scheduler.assert_drained()


def test_mixed_step_budget_keeps_outputs_exact(qwen3_dir: tuple[Path, torch.nn.Module]) -> None:
    """Prompts arriving while others decode take mixed_step_tokens-sized steps (here 16 of a
    64-token chunk budget): the same greedy tokens as each prompt run alone."""
    path, _ = qwen3_dir
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randrange(5, 50))] for _ in range(8)]
    alone_engine = make_engine(path, chunk=64, prefix_cache=False)
    alone = [generate(alone_engine, [p], max_tokens=8)[0] for p in prompts]
    mixed = make_engine(path, chunk=64, mixed_step_tokens=16)
    assert generate(mixed, prompts, max_tokens=8) == alone
    mixed.scheduler.assert_drained()


def test_preemption_keeps_outputs_exact(qwen3_dir: tuple[Path, torch.nn.Module]) -> None:
    path, _ = qwen3_dir
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 97) for _ in range(12)] for _ in range(6)]
    roomy = generate(make_engine(path), prompts, max_tokens=20)
    tight = make_engine(path, num_pages=24, chunk=64)  # 6 x 32 tokens need 48 pages: preemption
    assert generate(tight, prompts, max_tokens=20) == roomy
    assert tight.scheduler.num_preemptions > 0
    tight.scheduler.assert_drained()


def test_seeded_sampling_is_reproducible(qwen3_dir: tuple[Path, torch.nn.Module]) -> None:
    path, _ = qwen3_dir
    engine = make_engine(path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params: dict[str, object] = dict(temperature=1.0, seed=7)
    assert _sample(engine, prompt, params) == _sample(engine, prompt, params)
    assert _sample(engine, prompt, {**params, "seed": 8}) != _sample(engine, prompt, params)


def _sample(engine: Engine, prompt: list[int], params: dict[str, object]) -> list[int]:
    tokens: list[int] = []
    finished: list[bool] = []

    def sink(out: RequestOutput) -> None:
        tokens.extend(out.token_ids)
        finished.append(out.finished)

    engine.submit(
        Request(
            f"s{random.random()}", prompt, SamplingParams(max_tokens=15, ignore_eos=True, **params)
        ),
        sink,
    )  # type: ignore[arg-type]
    while not any(finished):
        engine.step()
    return tokens


def test_context_is_capped_at_what_the_kv_pool_holds(
    qwen3_dir: tuple[Path, torch.nn.Module],
) -> None:
    """A pool of 24 pages of 4 holds 96 tokens: a request can never go past that, so that is the
    engine's max_model_len (the gateway refuses prompt + max_tokens beyond it up front). It
    was the checkpoint's 256: a 60-token prompt asking for 100 tokens was accepted, decoded to
    96 tokens, was preempted and then failed ('request needs 97 tokens of KV cache')."""
    path, hf = qwen3_dir
    engine = make_engine(path, num_pages=24)
    assert engine.max_model_len == 96
    prompt = [(5 * i + 3) % 90 + 3 for i in range(60)]
    ended: list[RequestOutput] = []
    tokens: list[int] = []

    def sink(out: RequestOutput) -> None:
        tokens.extend(out.token_ids)
        if out.finished:
            ended.append(out)

    engine.submit(Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=100,
                                                        ignore_eos=True)), sink)
    while not ended:
        engine.step()
    assert (ended[0].finish_reason, ended[0].error) == ("length", "")
    assert tokens == hf_greedy(hf, prompt, 36)
    engine.scheduler.assert_drained()


class _LandingHooks:
    """A decode role's hooks without a transfer (a double of worker/decode.py's state machine):
    a request's memory is reserved when it arrives, and the next poll lands its first token (a
    room that succeeded) and seats it in the running batch."""

    def __init__(self, first_token: int) -> None:
        self.first_token = first_token
        self.arrived: list[tuple[Request, object]] = []

    def add_request(self, request: Request, scheduler) -> None:  # type: ignore[no-untyped-def]
        assert scheduler.reserve(request, request.num_prompt_tokens + 1)
        self.arrived.append((request, scheduler))

    def on_prompt_done(self, request: Request) -> bool:
        return False

    def poll(self) -> None:
        for req, sched in self.arrived:
            if sched.land(req, self.first_token, None):  # type: ignore[attr-defined]
                sched.seat(req)  # type: ignore[attr-defined]
        self.arrived.clear()

    def abort(self, request_id: str, reason: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.arrived)


def test_a_landed_first_token_leaves_before_the_decode_step_after_it(
    qwen3_dir: tuple[Path, torch.nn.Module],
) -> None:
    """PD decode: the first token (prefill's, landed with the KV) goes out as soon as the room
    lands, not with the first decode step's token (a step of TTFT; the client's first event
    held two tokens)."""
    path, _ = qwen3_dir
    engine = make_engine(path)
    engine.set_hooks(_LandingHooks(first_token=7))  # type: ignore[arg-type]
    batches: list[list[int]] = []

    def sink(out: RequestOutput) -> None:
        batches.append(list(out.token_ids))

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.submit(Request("pd-0", [3, 4, 5, 6, 8], params), sink)
    engine.step()  # the room lands and the first decode step runs
    assert batches[:1] == [[7]], batches  # the landed token alone, before the step's
    for _ in range(10):
        engine.step()
    assert sum(batches, [])[:1] == [7] and len(sum(batches, [])) == 4
