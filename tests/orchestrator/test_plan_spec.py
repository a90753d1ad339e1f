"""`tandem plan` says what speculative decoding the cluster would run, as the ready line does.

Before, the plan named no method and no k: with `speculative.method=ngram` it was the plan of
a cluster without speculation (ngram keeps no KV), and with a model drafter only the cache
table's `4 + 1 eagle` hinted at it.
"""

from __future__ import annotations

import pytest

from orchestrator.config import load_config
from orchestrator.plan_text import format_plan


@pytest.mark.parametrize(("config", "method", "k"), [
    ("configs/tiny-mono.yaml", "ngram", 3),
    ("configs/tiny-1p1d.yaml", "eagle", 5),
])
def test_plan_header_names_the_method_and_drafts_a_step(config: str, method: str,
                                                        k: int) -> None:
    cluster = load_config(config, [f"speculative.method={method}",
                                   f"speculative.num_speculative_tokens={k}"])
    header = format_plan(cluster).splitlines()[0]
    assert f"; speculative {method} k={k}; " in header, header


def test_plan_without_speculation_says_nothing_of_it() -> None:
    header = format_plan(load_config("configs/tiny-mono.yaml", [])).splitlines()[0]
    assert "speculative" not in header, header
