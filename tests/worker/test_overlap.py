"""Overlapped steps (`scheduler.overlap`) give exactly what the plain step gives.

With overlap a step of decodes (and prompt chunks joining them) is launched and counted before
the previous step's tokens are read; a request that stops on those tokens has already been put
in the next step (its token there is dropped). On a CPU the device is synchronous, so the
overlap gains nothing here, but every piece of its bookkeeping runs: PENDING slots, inputs read
from the previous step's tokens, late stops, prompts joining running decodes, steps that must
first read the tokens (penalties, logprobs), preemption with a step in flight, aborts. Each
case compares token for token (and finish reason) with `overlap: off`, and checks every page
came back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from worker.config import (
    CacheConfig,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams


def _engine(path: Path, overlap: str, num_pages: int = 256) -> Engine:
    return Engine(
        WorkerConfig(
            model=ModelConfig(path=str(path), dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=num_pages),
            scheduler=SchedulerConfig(max_num_seqs=6, chunked_prefill_size=24, overlap=overlap),  # type: ignore[arg-type]
            num_threads=1,
        )
    )


def _requests(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(14):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(2, 40))]
        kind = i % 7
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 24), ignore_eos=True)
        if kind == 1:  # stops on a common token, unknown to the host until a step later
            params = SamplingParams(
                temperature=0.0, max_tokens=30, stop_token_ids=tuple(range(0, 97, 3))
            )
        elif kind == 2:  # seeded sampling stays on the overlapped path
            params = SamplingParams(
                temperature=0.8, top_k=20, seed=i, max_tokens=12, ignore_eos=True
            )
        elif kind == 3:  # penalties read the tokens: plain steps while it runs
            params = SamplingParams(
                temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True
            )
        elif kind == 4:  # logprobs: plain steps too
            params = SamplingParams(
                temperature=0.0, max_tokens=8, logprobs=True, top_logprobs=2, ignore_eos=True
            )
        elif kind == 5:  # min_tokens masks the stop ids by count, which the host knows
            params = SamplingParams(
                temperature=0.0, max_tokens=16, min_tokens=5, stop_token_ids=(1, 2, 3, 4, 5)
            )
        out.append((prompt, params))
    return out


def _run(
    engine: Engine,
    reqs: list[tuple[list[int], SamplingParams]],
    stagger: int = 3,
    abort_at: dict[int, int] | None = None,
) -> list[tuple[list[int], str, int]]:
    """Submit `stagger` requests per step (so prefills join running decodes), run to the end."""
    got: dict[str, list[int]] = {}
    ends: dict[str, tuple[str, int]] = {}

    def sink_for(rid: str) -> Callable[[RequestOutput], None]:
        def sink(out: RequestOutput) -> None:
            assert all(t >= 0 for t in out.token_ids), out  # no PENDING slot ever leaves
            got[rid].extend(out.token_ids)
            if out.finished:
                ends[rid] = (out.finish_reason, len(out.logprobs))

        return sink

    rids = [f"r{i}-{random.random()}" for i in range(len(reqs))]
    pending = list(zip(rids, reqs, strict=True))
    step = 0
    while len(ends) < len(rids):
        for rid, (prompt, params) in pending[:stagger]:
            got[rid] = []
            engine.submit(Request(rid, prompt, params), sink_for(rid))
        pending = pending[stagger:]
        for i, at in (abort_at or {}).items():
            if at == step:
                engine.abort(rids[i])
        engine.step()
        step += 1
        assert step < 5000
    for sched in engine.schedulers:
        sched.assert_drained()
    return [(got[r], *ends[r]) for r in rids]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.worker.conftest import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("qwen3")
    build_tiny_checkpoint(path, "qwen3", max_position_embeddings=128)
    return path


def test_overlap_equals_plain_steps(checkpoint: Path) -> None:
    reqs = _requests(seed=1)
    plain = _run(_engine(checkpoint, "off"), reqs)
    on = _engine(checkpoint, "on")
    assert on.overlap
    late_stops = []  # requests that stopped while their next step was already launched
    complete = on.scheduler.complete

    def spy(plan, token_ids):  # noqa: ANN001, ANN202
        over = [
            c.request
            for c in plan.chunks
            if len(c.request.output_token_ids) > c.start + 2 - c.request.num_prompt_tokens
        ]
        complete(plan, token_ids)
        late_stops.extend(r for r in over if r.status.is_finished and r.finish_reason == "stop")

    on.scheduler.complete = spy  # type: ignore[method-assign]
    assert _run(on, reqs) == plain
    assert on.num_overlapped_steps >= 5, (on.num_overlapped_steps, on.num_steps)
    assert late_stops, "a request stopped on a token the host read a step late"


def test_a_prompt_joining_decodes_is_launched_before_their_tokens_are_read(
    checkpoint: Path,
) -> None:
    """A mixed step (a prompt joining running decodes) is overlapped too: it is launched first,
    then the in-flight step's tokens are read and delivered while it runs, and the prompt's
    first token follows a step later."""
    engine = _engine(checkpoint, "on")
    log: list[str] = []
    launch = engine.runner.launch

    def spy(plan, prev):  # noqa: ANN001, ANN202
        log.append("launch mixed" if any(c.num_tokens > 1 for c in plan.chunks) else "launch")
        return launch(plan, prev)

    engine.runner.launch = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.submit(Request("a", [5, 6, 7], params), lambda out: log.extend("a" * len(out.token_ids)))
    while engine._inflight is None:  # until a decode step of "a" is in flight
        engine.step()
    log.clear()
    engine.submit(Request("b", list(range(1, 12)), params),
                  lambda out: log.extend("b" * len(out.token_ids)))
    overlapped = engine.num_overlapped_steps
    engine.step()  # "b"'s prompt joins "a"'s decode: launched, then "a"'s token is read
    assert log == ["launch mixed", "a"], log
    assert engine.num_overlapped_steps == overlapped + 1
    engine.step()  # the next decode is launched, then the mixed step's tokens leave
    assert log[2:] == ["launch", "a", "b"], log
    while engine.has_pending_work():
        engine.step()
    engine.scheduler.assert_drained()


def test_overlap_with_preemption_and_aborts(checkpoint: Path) -> None:
    """Few pages: running requests are preempted while a step is in flight; two are aborted."""
    reqs = _requests(seed=2)
    aborts = {2: 4, 9: 8}  # request index -> engine step
    plain = _run(_engine(checkpoint, "off", num_pages=24), reqs, stagger=14, abort_at=aborts)
    on = _engine(checkpoint, "on", num_pages=24)
    got = _run(on, reqs, stagger=14, abort_at=aborts)
    assert on.scheduler.num_preemptions > 0
    for i, (a, b) in enumerate(zip(got, plain, strict=True)):
        if i in aborts:  # overlap may have emitted one step fewer when the abort landed
            assert a[1] == b[1] == "abort", i
            shorter, longer = sorted((a[0], b[0]), key=len)
            assert longer[: len(shorter)] == shorter and len(longer) - len(shorter) <= 1, i
        else:
            assert a == b, i


def test_overlap_auto_is_off_on_cpu_and_on_needs_one_rank(checkpoint: Path) -> None:
    assert not _engine(checkpoint, "auto").overlap
    with pytest.raises(ConfigError, match="scheduler.overlap=on needs a single-rank worker"):
        Engine(
            WorkerConfig(
                model=ModelConfig(path=str(checkpoint)),
                parallel=ParallelConfig(tp_size=2),
                scheduler=SchedulerConfig(overlap="on"),
            )
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_the_gpu_with_decode_graphs_equals_plain_steps(checkpoint: Path) -> None:
    """Where it pays: CUDA, graphs replaying with inputs read from the previous step's tokens."""

    def cuda_engine(overlap: str) -> Engine:
        eng = Engine(
            WorkerConfig(
                model=ModelConfig(path=str(checkpoint), dtype="float32"),
                cache=CacheConfig(page_size=4, num_pages=256),
                scheduler=SchedulerConfig(max_num_seqs=6, chunked_prefill_size=24, overlap=overlap),  # type: ignore[arg-type]
                parallel=ParallelConfig(device="cuda"),
            )
        )
        eng.warm_up()
        assert eng.runner.decode_graphs is not None
        return eng

    reqs = _requests(seed=3)
    plain = _run(cuda_engine("off"), reqs)
    on = cuda_engine("auto")
    assert on.overlap
    assert _run(on, reqs) == plain
    assert on.num_overlapped_steps >= 5


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(
    overlap: str, checkpoint: Path
) -> None:
    eng = _engine(checkpoint, overlap)
    boom = {"left": 1}
    forward, launch = eng.runner.forward, eng.runner.launch

    def fail_once(real):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if boom["left"] and eng.num_steps >= 3:
                boom["left"] = 0
                raise RuntimeError("device fell over")
            return real(*args, **kwargs)

        return call

    eng.runner.forward, eng.runner.launch = fail_once(forward), fail_once(launch)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs: dict[str, list[RequestOutput]] = {}
    for i in range(3):
        outs[f"a{i}"] = []
        eng.submit(Request(f"a{i}", [5, 6, 7, i], params), outs[f"a{i}"].append)
    for _ in range(100):
        eng.step()
    assert not boom["left"]
    assert all(
        o[-1].finish_reason == "error" and "device fell over" in o[-1].error for o in outs.values()
    )
    outs["b"] = []
    eng.submit(Request("b", [5, 6, 7], params), outs["b"].append)  # the engine still serves
    for _ in range(100):
        eng.step()
    assert outs["b"][-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs["b"]) == 8
    eng.scheduler.assert_drained()
