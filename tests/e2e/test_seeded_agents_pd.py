"""Seeded sampling through the gateway, under grammars, draws the same 1P1D as mono: n choices
(choice i samples with seed + i), forced tool calls and a JSON schema behind Qwen3's open think
block (the first token sampled by prefill under its matcher, the rest by decode), logprobs and
top_logprobs included. The checkpoint is tests/e2e/qwen3_chat_checkpoint.py's; the clusters
run one after the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from orchestrator.launch.background import running_cluster
from tests.e2e.qwen3_chat_checkpoint import build_qwen3_chat_checkpoint
from tests.e2e.test_openai_agent_client import ANSWER, ASK, PARSERS, TIME, WEATHER, pinned

pytestmark = pytest.mark.slow
REQUESTS: list[dict[str, Any]] = [
    {"seed": 123, "max_completion_tokens": 30},
    {"seed": 7, "tools": [WEATHER, TIME], "tool_choice": "required"},
    {"seed": 2**63 + 5, "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True, "schema": ANSWER}}},
]


def answers(config: str, model: Path, tmp: Path, roles: tuple[str, ...]) -> list[Any]:
    port, sets = pinned(20, roles)
    tmp.mkdir()
    with running_cluster(config, *PARSERS, *sets, model=model, port=port, tmp=tmp) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        out = []
        for kw in REQUESTS:
            args: dict[str, Any] = {"model": model.name, "messages": ASK, "n": 2,
                                    "temperature": 1.0, "logprobs": True, "top_logprobs": 2,
                                    "max_completion_tokens": 60, **kw}
            r = client.chat.completions.create(**args)
            for ch in r.choices:
                dump = ch.model_dump(exclude_none=True)
                for call in dump["message"].get("tool_calls", []):
                    call.pop("id")  # each response draws its own
                out.append(dump)
        c.wait_drained()
    return out


def logprobs_apart(choice: dict[str, Any], values: bool = False) -> Any:
    """The choice with its logprob values taken out, or (`values`) those values alone."""
    entries = [[entry, *entry["top_logprobs"]] for entry in choice["logprobs"]["content"]]
    if values:
        return [e["logprob"] for row in entries for e in row]
    return {**choice, "logprobs": [[(e["token"], e["bytes"]) for e in row] for row in entries]}


def test_seeded_choices_under_grammars_pd_equal_mono(tmp_path: Path) -> None:
    model = build_qwen3_chat_checkpoint(tmp_path / "qwen3-chat")
    pd = answers("configs/tiny-1p1d.yaml", model, tmp_path / "pd", ("prefill", "decode"))
    mono = answers("configs/tiny-mono.yaml", model, tmp_path / "mono", ("both",))
    assert [logprobs_apart(a) for a in pd] == [logprobs_apart(a) for a in mono]
    for a, b in zip(pd, mono, strict=True):  # the same but for float rounding in batches
        assert logprobs_apart(a, values=True) == pytest.approx(  # of other shapes
            logprobs_apart(b, values=True), abs=1e-4)
    assert any(a["message"].get("tool_calls") for a in pd)  # the grammars' cases came up
    assert len({a["message"].get("content") for a in pd}) > 2  # and the seeds differ
