"""The launchers' eval gate (launcher.eval_on_ready, Slurm and Ray) runs the task the config's
eval section names, the way `tandem eval` runs it: lookup through the chat tool loop."""

from __future__ import annotations

import io
from urllib.parse import urlsplit

from orchestrator.config import REPO_ROOT, load_config
from orchestrator.launch.slurm import run_gate
from tests.orchestrator.chat_double import ChatDouble, ChatDoubleState


def test_the_gate_runs_lookup_through_the_tool_loop() -> None:
    # It sent lookup's prompts as raw /v1/completions: every request failed, the gate too.
    state = ChatDoubleState()
    with ChatDouble(state) as url:
        cluster = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml", [
            f"gateway.port={urlsplit(url).port}", "eval.task=lookup", "eval.samples=4",
            "eval.concurrency=2", "eval.min_accuracy=1.0"])
        out, err = io.StringIO(), io.StringIO()
        assert run_gate(cluster, out, err) == 0, err.getvalue()
    assert "accuracy: 1.000 (4/4)" in out.getvalue()
    assert state.requests and all("messages" in body for body in state.requests)
