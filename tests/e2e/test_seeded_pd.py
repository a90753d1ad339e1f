"""Seeded sampling under PD draws what mono draws: prefill samples the first token from the
seed's first draw, so decode, whose generator starts from the same seed, must skip that draw.
It used to take it again for the second token: the first two tokens reused one draw (with a
flat distribution they came out equal for 53 of 60 seeds, against 1 of 60 in mono), and every
later token was one draw behind mono's.

In process: real engines, real transfer (Mooncake over loopback TCP), the harness of
tests/e2e/test_window_pd.py."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

import pytest

from tests.e2e.test_window_pd import Leg, _config, _wait, running
from tests.worker.conftest import build_tiny_checkpoint
from worker.config import SpeculativeConfig, WorkerConfig
from worker.request import Request
from worker.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 33, 9, 70, 12, 41, 8, 90, 3, 64]  # ids < the tiny vocab (97)


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, max_tokens=12, ignore_eos=True, seed=seed)


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_seeded_sampling_pd_equals_mono(tmp_path: Path, spec: str) -> None:
    build_tiny_checkpoint(tmp_path, "qwen3", seed=3)  # random weights: flat next-token odds
    seeds = (1, 7, 12345, 2**63 + 12345)  # the last: a CPU generator seeded past 32 bits

    def config(role: str) -> WorkerConfig:
        return dataclasses.replace(_config(tmp_path, role),
                                   speculative=SpeculativeConfig(method=spec))  # type: ignore[arg-type]

    with running(config("both")) as mono:
        want = []
        for s in seeds:
            leg = Leg()
            mono.engine.submit(Request(f"m{s}", list(PROMPT), _params(s)), leg.sink)
            _wait(leg)
            want.append(leg.tokens)
    with running(config("prefill")) as prefill, running(config("decode")) as decode:
        addr = prefill.info["bootstrap_addr"]
        for s, tokens in zip(seeds, want, strict=True):
            room, pre, dec = secrets.randbits(64), Leg(), Leg()
            for worker, leg in ((prefill, pre), (decode, dec)):
                worker.engine.submit(Request(f"pd{s}", list(PROMPT), _params(s), room=room,
                                             bootstrap_addr=addr), leg.sink)
            _wait(pre, dec)
            assert dec.finish == "length", dec.error
            assert dec.tokens == tokens, f"seed {s}"
