"""`tandem bench --config`: the engine in-process against the config's cluster at each
concurrency, as a user runs it; and the one-line refusals of what it cannot measure."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from orchestrator.bench_engine import decode_ratio, engine_config, ratio
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.launch.background import REPO


@pytest.mark.slow
def test_served_vs_engine_on_the_mono_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A cluster already serving on the port the config pins: the bench's own cluster takes
    # free ports, so it starts beside it.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = main(["bench", "--config", "configs/tiny-mono.yaml", "--concurrency", "2,4",
                   "--num-requests", "8", "--input-len", "24", "--output-len", "128", "--seed",
                   "3", "--set", "roles.both.num_threads=1", "--set",
                   f"roles.both.base_port={busy.getsockname()[1]}", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "served_engine.json").read_text())
    assert not result["pd"] and [row["b"] for row in result["rows"]] == [2, 4]
    for row in result["rows"]:
        engine, served = row["engine"], row["served"]
        assert served["completed"] == 8 and served["failed"] == 0
        assert served["output_tokens"] == 8 * 128  # ignore_eos: every token of every request
        assert engine["output_tok_s"] > 0 and engine["decode_tok_s"] > 0
        assert engine["steps"]["decode"]["n"] > 0  # the engine decoded in batches
        assert 0.02 < ratio(row, pd=False) < 10, row
        # the first wave's window: every one of the B requests decoding at once (128 tokens:
        # a loaded box's late first token still leaves the window its 16 steps)
        window = (served["decode_throughput"], served["ttft_ms"], served["tpot_ms"])
        assert served["decode_throughput"] is not None, window
        assert served["decode_throughput"] > 0 and 0.02 < (decode_ratio(row) or 0) < 10, row
        assert f"| {row['b']} | {engine['output_tok_s']} |" in out  # the printed table
    assert "served / engine" in out
    assert (tmp_path / "served_engine.png").stat().st_size > 10_000
    assert (tmp_path / "served_engine.md").read_text() in out


def test_a_pd_configs_engine_is_its_decode_worker() -> None:
    cluster = load_config(REPO / "configs/tiny-1p1d.yaml",
                          ["roles.decode.num_threads=1", "roles.prefill.num_threads=2",
                           "roles.decode.scheduler.max_num_seqs=7"])
    config = engine_config(cluster)
    assert config.role == "both"
    assert config.num_threads == 1 and config.scheduler.max_num_seqs == 7
    mono = engine_config(load_config(REPO / "configs/tiny-mono.yaml"))
    assert mono.role == "both"


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "999"], "--concurrency 999 is above the config's scheduler.max_num_seqs"),
    (["--set", "roles.both.scheduler.max_num_seqs=3", "--concurrency", "2,4"],
     "--concurrency 4 is above the config's scheduler.max_num_seqs (3)"),
    (["--request-rate", "2"], "--request-rate: served / engine measures closed loops"),
    (["--dataset", "shared-prefix"], "--dataset shared-prefix: served / engine runs the random"),
    (["--set", "scheduler.nope=1"], "unknown key 'nope' in 'scheduler'"),
])
def test_what_it_cannot_measure_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--config", "configs/tiny-mono.yaml", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        err.strip().splitlines()[-1]]


def test_set_without_config_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--url", "http://127.0.0.1:9", "--set", "a.b=1"]) == 2
    assert "--set needs --config" in capsys.readouterr().err
