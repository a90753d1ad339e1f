"""The local launcher's `ready:` line says what runs: model, workers, transfer, speculation."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import REPO_ROOT, load_config
from orchestrator.launch.describe import ready_line

TINY = REPO_ROOT / "configs" / "tiny-1p1d.yaml"


def test_the_ready_line_says_speculation_is_on_and_how() -> None:
    cluster = load_config(TINY, ["speculative.method=eagle", "launcher.cluster_id=c1"])
    line = ready_line(cluster, Path("logs/8000"))
    assert "; mooncake tcp; speculative eagle k=3; cluster c1; " in line, line
    cluster = load_config(TINY, ["speculative.method=ngram",
                                 "speculative.num_speculative_tokens=5"])
    assert "; speculative ngram k=5; " in ready_line(cluster, Path("logs/8000"))
    off = ready_line(load_config(TINY), Path("logs/8000"))
    assert "speculative" not in off, off
