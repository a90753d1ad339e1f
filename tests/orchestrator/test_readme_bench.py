"""The README's `tandem bench` commands run against the cluster the README starts (`make
serve`: the embedded model, 512 positions, one token per character): every prompt they send,
a shared-prefix conversation's last turn included, fits with its output. The shared-prefix
line used to take the default --prefix-len 512, so all its requests were a 400."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from orchestrator.bench_data import random_sessions, shared_prefix_sessions
from orchestrator.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _bench_lines() -> list[list[str]]:
    out = []
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(".venv/bin/tandem bench "):
            out.append(shlex.split(line.split("#")[0])[1:])
    return out


def _longest(argv: list[str]) -> int:
    """Tokens of the longest prompt the command sends plus its output (characters: the
    embedded model's tokenizer has one token per character; an answer is output_len tokens)."""
    a = build_parser().parse_args(argv)
    if a.dataset == "shared-prefix":
        sessions = shared_prefix_sessions(max(1, a.num_requests // a.num_turns), a.input_len,
                                          a.output_len, a.seed, a.num_groups, a.prefix_len,
                                          a.num_turns)
        longest = 0
        for s in sessions:
            history = "".join(f"{t}{'x' * a.output_len}\n" for t in s.turns[:-1])
            longest = max(longest, len(s.prompt(len(s.turns) - 1, history)))
        return longest + a.output_len
    sessions = random_sessions(a.num_requests, a.input_len, a.output_len, a.seed, a.prompt_kind,
                               a.vocab_size, max(a.long_every, 0), a.long_input_len,
                               a.range_ratio)
    return max(len(s.prompt(0, "")) + s.max_tokens for s in sessions)


def test_every_readme_bench_command_fits_the_embedded_model() -> None:
    lines = _bench_lines()
    assert any("shared-prefix" in argv for argv in lines), "the README lost its bench commands"
    limit = json.loads((REPO / "models" / "tandem-arith" / "config.json").read_text())[
        "max_position_embeddings"]
    for argv in lines:
        assert _longest(argv) <= limit, f"`tandem {shlex.join(argv)}` sends more than {limit}"
