"""Hybrid sliding-window models on the engine (CPU): window layers keep a ring of pages.

Fidelity against transformers for prompts shorter and longer than the window, prefix hits with
bounded replay (the ring rebuilt exactly, cached_tokens a page multiple), and no leaked pages
or rings on any path."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from tests.worker.test_engine import generate, hf_greedy, make_engine
from tests.worker.window_model import WINDOW, build_window_checkpoint
from worker.config import ConfigError
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen2-window")
    return path, build_window_checkpoint(path)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


def test_window_group_is_a_ring(window_dir: tuple[Path, torch.nn.Module]) -> None:
    engine = make_engine(window_dir[0], chunk=16)
    shape = engine.kv.shape
    assert shape.window_layers == (1, 2, 3) and shape.window == WINDOW
    assert shape.ring_pages == WINDOW // 4 + 1
    assert (
        engine.kv.data.shape[1] == 1 and engine.kv.window.shape[1] == 3
    )  # full pages hold layer 0 only


def test_window_model_equals_transformers(window_dir: tuple[Path, torch.nn.Module]) -> None:
    path, hf = window_dir
    assert hf.config.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    engine = make_engine(path, chunk=16)
    prompts = _prompts(0, (5, WINDOW - 1, WINDOW, 23, 45))  # shorter and longer than the window
    ours = generate(engine, prompts, max_tokens=14)  # decodes past the window too
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 14), f"prompt of {len(prompt)} tokens"
    engine.scheduler.assert_drained()


def _run_one(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    out: list[int] = []
    cached: list[int] = []
    done: list[bool] = []

    def sink(o: RequestOutput) -> None:
        assert o.finish_reason != "error", o.error
        out.extend(o.token_ids)
        if o.num_prompt_tokens:
            cached.append(o.num_cached_tokens)
        if o.finished:
            done.append(True)

    engine.submit(
        Request(
            f"r{random.random()}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        ),
        sink,
    )
    while not done:
        engine.step()
    return out, cached[0]


def test_prefix_hit_replays_a_bounded_suffix(window_dir: tuple[Path, torch.nn.Module]) -> None:
    path, hf = window_dir
    engine = make_engine(path, chunk=16)
    sched = engine.scheduler
    window = sched.cache.window
    assert window is not None and window.spec.replay_tokens == 3 * (WINDOW - 1)
    shared = _prompts(1, (48,))[0]
    first, cached0 = _run_one(engine, shared + [5, 6, 7], 6)
    assert cached0 == 0
    computed_before = sched.prompt_tokens_computed
    prompt = shared + [9, 10, 11, 12, 13]
    got, cached = _run_one(engine, prompt, 10)
    assert got == hf_greedy(hf, prompt, 10)  # the ring was rebuilt exactly
    hit = 48  # 12 full pages of 4 tokens in the tree
    replay_from = (hit - 3 * (WINDOW - 1)) // 4 * 4
    assert cached == replay_from and cached % 4 == 0
    # Only the replayed suffix and the new tokens ran through the model.
    assert sched.prompt_tokens_computed - computed_before == len(prompt) - replay_from
    assert first == hf_greedy(hf, shared + [5, 6, 7], 6)
    sched.assert_drained()


def test_short_hit_replays_everything(window_dir: tuple[Path, torch.nn.Module]) -> None:
    path, hf = window_dir
    engine = make_engine(path, chunk=16)
    prompt = _prompts(2, (12,))[0]
    _run_one(engine, prompt + [1], 3)
    got, cached = _run_one(engine, prompt + [2, 3], 5)  # hit of 12 tokens < replay bound: no saving
    assert cached == 0 and got == hf_greedy(hf, prompt + [2, 3], 5)
    engine.scheduler.assert_drained()


def test_batch_with_preemption_and_abort_frees_rings(
    window_dir: tuple[Path, torch.nn.Module],
) -> None:
    path, hf = window_dir
    # Few pages: the batch preempts; rings come back each time (assert_drained checks both pools).
    engine = make_engine(path, chunk=16, num_pages=30, max_num_seqs=4)
    prompts = _prompts(3, (30, 31, 29, 33))
    ours = generate(engine, prompts, max_tokens=20)
    assert engine.scheduler.num_preemptions > 0
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 20)
    engine.scheduler.assert_drained()
    finished: list[str] = []
    def sink(o: RequestOutput) -> None:
        if o.finished:
            finished.append(o.finish_reason)

    engine.submit(Request("gone", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True)), sink)
    engine.step()
    engine.step()
    assert engine.scheduler.stats().window_used_pages  # running: holds its ring
    engine.abort("gone")
    engine.step()
    assert finished == ["abort"]
    engine.scheduler.assert_drained()


def test_chunk_smaller_than_window_plus_a_page_is_refused(
    window_dir: tuple[Path, torch.nn.Module],
) -> None:
    with pytest.raises(ConfigError, match="chunked_prefill_size"):
        make_engine(window_dir[0], chunk=WINDOW + 3)


def test_full_model_twin_has_no_ring(tmp_path: Path) -> None:
    build_window_checkpoint(tmp_path, window=False)
    engine = make_engine(tmp_path, chunk=16)
    assert engine.kv.shape.window_layers == () and engine.scheduler.cache.window is None


def test_fp8_rings_do_not_depend_on_how_the_prompt_was_chunked(
    window_dir: tuple[Path, torch.nn.Module],
) -> None:
    """FP8 pages: a window layer read this step's K/V unrounded and the ring's history as e4m3,
    so where a step boundary fell (alone, or sharing the step budget with another prompt)
    changed greedy tokens; full layers always read e4m3. Alone must equal batched."""
    path, _ = window_dir

    def fp8_engine() -> Engine:
        engine = make_engine(path, chunk=16, prefix_cache=False)
        config = engine.config
        engine.close()
        cache = dataclasses.replace(config.cache, kv_cache_dtype="fp8_e4m3")
        return Engine(config.replace(cache=cache))

    prompts = _prompts(7, (60, 100))
    batched = generate(fp8_engine(), prompts, max_tokens=20)
    alone = [generate(fp8_engine(), [p], max_tokens=20)[0] for p in prompts]
    assert batched == alone
