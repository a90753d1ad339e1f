"""The CLI as a newcomer uses it: `tandem eval` / `tandem bench` given the URL an OpenAI
client is given (http://host:port/v1), which names the same server as its root URL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchestrator.cli import main
from orchestrator.launch.background import REPO, free_ports, running_cluster
from orchestrator.tasks import arith
from tests.listeners import descendants
from tests.orchestrator.openai_double import DoubleState, OpenAIDouble


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_eval_takes_the_openai_base_url(suffix: str, capsys: pytest.CaptureFixture[str]) -> None:
    problems = arith.make_problems(4, 7)
    state = DoubleState(answers={p.prompt: p.answer for p in problems})
    with OpenAIDouble(state) as url:
        rc = main(["eval", "--url", url + suffix, "--task", "arith", "--samples", "4",
                   "--concurrency", "2", "--seed", "7"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() == "accuracy: 1.000 (4/4)"


def test_bench_takes_the_openai_base_url(capsys: pytest.CaptureFixture[str]) -> None:
    with OpenAIDouble(DoubleState()) as url:
        rc = main(["bench", "--url", url + "/v1", "--input-len", "8", "--output-len", "4",
                   "--num-requests", "3", "--concurrency", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["completed"] == 3


def test_bench_prints_the_percentiles_the_readme_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README: `tandem bench` reports TTFT, TPOT, ITL and E2E at p50/p90/p95/p99; its text
    report printed p95 only under --json."""
    with OpenAIDouble(DoubleState()) as url:
        rc = main(["bench", "--url", url, "--input-len", "8", "--output-len", "4",
                   "--num-requests", "3", "--concurrency", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rows = {line.split(" ms")[0]: line for line in out.out.splitlines() if " ms " in line}
    assert set(rows) == {"TTFT", "TPOT", "ITL", "E2E"}, out.out
    for row in rows.values():
        assert [w for w in row.split() if w.startswith("p")] == ["p50", "p90", "p95", "p99"], row


@pytest.mark.slow
def test_a_second_cluster_pointed_at_a_running_clusters_run_dir_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """docs/config.md, `launcher.run_dir`: a newcomer who gives the second cluster the first's
    run directory (or its log_dir and port on another host) used to move the running cluster's
    logs and cluster.yaml to `.prev` under it (a `--join` with logs/<port>/cluster.yaml then
    named the wrong cluster). Now the second launch is refused in one line before it starts
    anything; the first serves on, its files where they were; Ctrl-C on the first then stops
    every process it started."""
    with running_cluster("configs/tiny-mono.yaml", tmp=tmp_path) as first:
        config = first.log_dir / "cluster.yaml"
        before = config.read_text()
        second = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "serve", "--config",
             "configs/tiny-mono.yaml", "--port", str(free_ports(1)[0]),
             "--set", f"launcher.run_dir={first.log_dir}"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
        assert second.returncode == 2, second.stderr
        assert second.stderr == (f"error: launcher.run_dir: {first.log_dir} is the run directory "
                                 "of a cluster that is still running; give this cluster its own "
                                 "(another --port, or launcher.run_dir)\n")
        assert second.stdout == ""  # no `run dir:` line: nothing was started
        assert config.read_text() == before and not first.log_dir.with_name(
            first.log_dir.name + ".prev").exists()
        assert httpx.get(f"{first.url}/health", timeout=5).status_code == 200
        tree = descendants(first.proc.pid)
        assert len(tree) >= 3  # the launcher, its worker and its gateway
        first.proc.send_signal(signal.SIGINT)  # Ctrl-C reaches the launcher alone (own sessions)
        assert first.proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert [p for p in tree if Path(f"/proc/{p}").exists()] == [], "orphans after Ctrl-C"
        out = (tmp_path / "serve.out").read_text()
        assert out.splitlines()[-1] == f"stopped: lb (0), both-0 (0); logs in {first.log_dir}"
