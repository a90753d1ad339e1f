"""Speculative decoding for requests with penalties or a logit bias.

A model's generation_config.json often sets `repetition_penalty` (Qwen2.5's instruct and coder
checkpoints: 1.05-1.1), and the gateway gives it to every request that leaves the field out
(vLLM's `--generation-config auto`). If such requests decoded one token a step, speculation
would do nothing for them, with no sign of it. vLLM verifies drafts under penalties: row i of
a verify step is the distribution of output token n + i, so its penalties count the tokens
generated so far plus drafts 0..i-1, exactly as plain decoding would after accepting them.

- Greedy requests with repetition / presence / frequency penalties, a logit bias and
  min_tokens get drafts, and their tokens equal those of an engine without speculation, token
  for token (ngram and the embedded model's EAGLE head).
- Each verify row is what the plain sampler would process for that output token (bias, then
  penalties over the tokens before it, then min_tokens bans).
- Seeded sampling with penalties and drafts reproduces; every page comes back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrator.launch.background import EMBEDDED_MODEL
from orchestrator.tasks import arith
from tests.worker.test_spec import _engine, _generate
from worker.sampler import Sampler
from worker.sampling import SamplingParams
from worker.spec.verify import verify_rows


@pytest.fixture(scope="module")
def arith_prompts() -> list[list[int]]:
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
    return [tok.encode(p.prompt) for p in arith.make_problems(8, seed=21)]


def _penalized(i: int) -> SamplingParams:
    kinds = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.8),
        dict(frequency_penalty=0.6, min_tokens=6),
        dict(logit_bias=((37, -2.0), (25, 1.5))),
        dict(repetition_penalty=1.1, frequency_penalty=0.3, logit_bias=((20, 3.0),)),
    ]
    return SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=i % 2 == 0,
                          **kinds[i % len(kinds)])  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_penalized_greedy_requests_get_drafts_and_equal_plain_greedy(
        method: str, arith_prompts: list[list[int]]) -> None:
    plain = _generate(_engine("none"), arith_prompts, _penalized)
    engine = _engine(method, k=4)
    got = _generate(engine, arith_prompts, _penalized)
    assert engine.spec_counters.drafted > 0  # before: such requests never drafted
    assert got == plain
    engine.scheduler.assert_drained()


def test_verify_rows_are_the_plain_samplers_rows() -> None:
    torch.manual_seed(0)
    vocab, k = 12, 4
    logits = torch.randn(k + 1, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, ignore_eos=False,
                            repetition_penalty=1.4, presence_penalty=0.5,
                            frequency_penalty=0.25, logit_bias=((3, 2.0), (7, -1.0)))
    generated, drafts, eos = [3, 5, 3], [7, 3, 0, 9], (0,)
    rows = verify_rows(logits, params, generated, drafts, eos)
    for i in range(k + 1):
        # The plain sampler's view of output token len(generated) + i: one row, its history.
        history = generated + drafts[:i]
        out = Sampler().sample(logits[i : i + 1].clone(),
                               [replace(params, top_logprobs=vocab)],
                               [None], [history], [len(history)], eos)
        assert out.top_logprobs is not None
        want = sorted(out.top_logprobs[0])
        got_lp = torch.log_softmax(rows[i], dim=-1)
        got = sorted((t, float(got_lp[t])) for t in range(vocab) if got_lp[t] != -float("inf"))
        assert [t for t, _ in got] == [t for t, _ in want], i
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(got, want, strict=True)), i
    assert torch.equal(logits, logits.clone())  # the input rows were not changed in place


def test_seeded_sampling_with_penalties_and_drafts_reproduces(
        arith_prompts: list[list[int]]) -> None:
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_k=30, seed=40 + i, max_tokens=16,
                              repetition_penalty=1.2, presence_penalty=0.3, ignore_eos=True)

    runs = []
    for _ in range(2):
        engine = _engine("eagle", k=3)
        runs.append(_generate(engine, arith_prompts[:5], params))
        assert engine.spec_counters.drafted > 0
        engine.scheduler.assert_drained()
    assert runs[0] == runs[1]
