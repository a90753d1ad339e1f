"""Constrained decoding on CUDA: the bitmask applied by xgrammar's Triton kernel masks exactly
what the CPU kernel masks (padding beyond the tokenizer included), and a CUDA engine (graphs,
overlapped decode on) serves constrained requests beside unconstrained ones with the tokens of
plain steps. Skipped where there is no GPU (the lead runs them on an H200:
bench/device/grammar.sh)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.worker.grammar_helpers import EMBEDDED, MAX_TOKENS, check_output, corpus
from tests.worker.test_grammar_engine import TOK, constrained, run
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.grammar_xgr import GrammarMask
from worker.request import Request
from worker.sampler import Sampler
from worker.sampling import SamplingParams

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs CUDA and triton")]


def test_cuda_mask_equals_cpu_mask_and_covers_the_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, width = 1000, 30  # the mask covers 960 ids; the logits have 40 more (padding)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, width), generator=gen, dtype=torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [0, 2, 3]
    cpu, gpu = logits.clone(), logits.cuda()
    GrammarMask(bitmask, rows).apply(cpu)
    GrammarMask(bitmask.pin_memory(), rows).apply(gpu)
    assert torch.equal(cpu, gpu.cpu())
    assert torch.isinf(cpu[rows, 960:]).all() and torch.equal(cpu[1], logits[1])
    params = [SamplingParams(temperature=0.0, logit_bias=((7, 3.0),))] * 5
    picks = [Sampler().sample(x, params, [None] * 5, [[]] * 5, [0] * 5, (0,),
                              GrammarMask(bitmask, rows)).token_ids
             for x in (logits, logits.cuda())]
    assert picks[0] == picks[1]


def _cuda_engine(overlap: str) -> Engine:
    engine = Engine(WorkerConfig(
        model=ModelConfig(path=str(EMBEDDED.parent), dtype="float32"),
        cache=CacheConfig(page_size=16, num_pages=512),
        scheduler=SchedulerConfig(max_num_seqs=32, chunked_prefill_size=256,
                                  overlap=overlap),  # type: ignore[arg-type]
        parallel=ParallelConfig(device="cuda"),
    ))
    engine.warm_up()  # captures the decode graphs
    return engine


def test_cuda_engine_serves_constrained_beside_unconstrained() -> None:
    """Overlap on (auto on CUDA) gives the plain steps' tokens: constrained rows never ride an
    overlapped step, the unconstrained neighbour does once they are done."""
    cases = corpus()

    def requests() -> list[Request]:
        free = Request("free", TOK.encode("a=1;b=2;\nb?").ids,
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return [constrained(c, c.name) for c in cases] + [free]

    plain_engine = _cuda_engine("off")
    plain = run(plain_engine, requests())
    engine = _cuda_engine("auto")
    assert engine.overlap and engine.runner.decode_graphs is not None
    got = run(engine, requests())
    assert engine.num_overlapped_steps > 0
    for c in cases:
        assert got[c.name].tokens == plain[c.name].tokens, c.name
        check_output(c, got[c.name].text)
    assert got["free"].tokens == plain["free"].tokens
    for e in (engine, plain_engine):
        assert e.grammars.num_live == 0
        e.scheduler.assert_drained()
