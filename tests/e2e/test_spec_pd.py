"""Speculative decoding end to end: n-gram drafts on mono and on 1P1D's decode worker give the
exact greedy output of a cluster without speculation, /metrics shows the acceptance, and
`tandem bench` reports the mean accepted length. The prompts are arith's and, rendered by the
embedded model's chat template, its agent formats (thinking, tool calls, answers after tool
results), whose outputs hold the tokenizer's added tokens (<think>, <tool_call>, ...)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import pytest

from orchestrator.bench import BenchSpec, bench_main
from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster
from orchestrator.tasks import arith
from tests.e2e.test_pd import complete_all

pytestmark = pytest.mark.slow
SPEC = ("speculative.method=ngram", "speculative.num_speculative_tokens=4")


def agent_prompts(n: int, seed: int) -> list[str]:
    """`n` prompts in the embedded model's chat formats other than plain arith, as the text
    the gateway renders (models/eagle_prompts.py, the drafters' training prompts)."""
    import random

    from transformers import AutoTokenizer

    from models.eagle_prompts import Format, render

    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    rng = random.Random(seed)
    formats = [f for f in Format if f is not Format.RAW]
    return [render(tok, rng, formats[i % len(formats)]) for i in range(n)]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in arith.make_problems(40, seed=23)] + agent_prompts(12, seed=23)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, prompts: list[str]) -> list[str]:
    with running_cluster("configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("plain")) as c:
        return asyncio.run(complete_all(c.url, prompts, 24))


def _lines_within(url: str, prefix: str, timeout_s: float) -> list[str]:
    """/metrics lines starting with `prefix`, once there are any (the gateway mirrors its
    workers' loads on its poll), or [] after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                 if ln.startswith(prefix)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def _metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


@pytest.mark.parametrize("config", ["configs/tiny-mono.yaml", "configs/tiny-1p1d.yaml"])
def test_ngram_equals_plain_greedy_and_reports_acceptance(config: str, prompts: list[str],
                                                          plain: list[str], tmp_path: Path) -> None:
    with running_cluster(config, *SPEC, tmp=tmp_path) as c:
        # The series exist (at zero, with every bucket) before the first draft is verified.
        lines = _lines_within(c.url, "tandem_spec_accepted_length_bucket{", 10.0)
        assert sorted(line.split('le="')[1].split('"')[0] for line in lines) == [
            "+Inf", "1.0", "2.0", "3.0", "4.0", "5.0"]
        assert all(line.endswith(" 0.0") for line in lines)
        got = asyncio.run(complete_all(c.url, prompts, 24))
        loads = c.wait_drained()
        out = io.StringIO()
        assert bench_main(c.url, BenchSpec(input_len=64, output_len=32, num_requests=4,
                                           concurrency=2), False, out, io.StringIO()) == 0
        accepted = _metric(c.url, "tandem_spec_accepted_tokens_total")
        drafted = _metric(c.url, "tandem_spec_draft_tokens_total")
        rate = _metric(c.url, "tandem_spec_acceptance_rate")
    assert got == plain  # token for token: greedy acceptance is lossless
    assert drafted > 0 and 0 < accepted <= drafted and 0 < rate <= 1
    assert "mean accepted length" in out.getvalue()
    drafter = loads["decode-0" if "1p1d" in config else "both-0"]
    assert drafter.spec.accepted_tokens > 0
    if "1p1d" in config:
        assert not loads["prefill-0"].HasField("spec")  # prefill never drafts
        assert loads["decode-0"].prompt_tokens_computed == 0  # nor does decode run the prompt
