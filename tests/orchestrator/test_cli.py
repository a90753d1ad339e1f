"""`tandem` argument parsing and the light subcommands (plan, launch errors, serve's config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import build_parser, main, serve_config
from orchestrator.config import DEFAULT_CONFIG, REPO_ROOT, resolve_config_path

TINY_HF = {
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 128,
    "head_dim": 32,
    "torch_dtype": "float32",
    "vocab_size": 40,
}


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert main([]) == 2  # a subcommand is required
    assert main(["worker", "--config", "x.yaml"]) == 2  # --role is required
    assert (
        main(["bench", "--url", "u", "--concurrency", "2", "--request-rate", "3"]) == 2
    )  # exclusive
    assert "not allowed with argument" in capsys.readouterr().err
    # a misspelled flag: one line naming the command, the argument and the closest flag
    assert main(["serve", "--prot", "8011"]) == 2
    assert capsys.readouterr().err == (
        "error: tandem serve: unrecognized argument '--prot'; did you mean --port?\n")
    assert main(["plan", "--config", "x.yaml", "--zzz"]) == 2
    assert capsys.readouterr().err.endswith("'--zzz'; see tandem plan --help\n")


def test_parser_defaults_and_repeated_set() -> None:
    args = build_parser().parse_args(["serve", "--set", "a.b=1", "--set", "c=2", "--port", "9001"])
    assert args.config is None and args.overrides == ["a.b=1", "c=2"] and args.port == 9001
    assert resolve_config_path(None) == DEFAULT_CONFIG
    # A relative path that is not here is looked up in the repository.
    assert (
        resolve_config_path("configs/tiny-mono.yaml").resolve()
        == (REPO_ROOT / "configs/tiny-mono.yaml").resolve()
    )
    args = build_parser().parse_args(["worker", "--config", "c.yaml", "--role", "decode"])
    assert args.replica == 0


def test_serve_config_applies_flags(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(model),
            "--dtype",
            "bfloat16",
            "--port",
            "9100",
            "--set",
            "launcher.kind=local",
            "--set",
            "roles.decode.count=2",
        ]
    )
    c = serve_config(args)
    assert c.model.path == str(model.resolve()) and c.served_model_name == "my-model"
    assert c.model.dtype == "bfloat16" and c.gateway.port == 9100
    assert c.launcher.kind == "local"  # serve always runs the local launcher
    # (a --set launcher.kind=ray is refused: tests/orchestrator/test_bad_input.py)
    assert c.roles.decode is not None and c.roles.decode.count == 2
    named = serve_config(
        build_parser().parse_args(["serve", "--model", str(model), "--served-model-name", "m1"])
    )
    assert named.served_model_name == "m1"


def test_plan_prints_table_and_kv_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    rc = main(["plan", "--config", "configs/tiny-2p2d.yaml", "--set", f"model.path={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    # The shipped configs leave worker ports unset: the local launcher picks them ("-" here).
    assert any(
        line.split()[:6] == ["decode-1", "decode", "1", "127.0.0.1", "-", "cpu"] for line in lines
    )
    assert any(line.split()[:2] == ["lb", "gateway"] for line in lines)
    # 4 layers * K,V * 2 kv heads * 16 tokens * 32 dims * 4 bytes = 32768 bytes per page;
    # 8192/16 pages.
    assert any(line.split()[:4] == ["decode", "512", "16", "32768"] for line in lines), out
    assert "16.0 MiB" in out


def test_plan_checks_tp_divisibility(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    rc = main(
        [
            "plan",
            "--config",
            "configs/tiny-1p1d.yaml",
            "--set",
            f"model.path={tmp_path}",
            "--set",
            "roles.prefill.parallel.tp_size=3",
        ]
    )
    assert rc == 2
    assert (
        "roles.prefill.parallel.tp_size=3 must divide num_attention_heads=4"
        in capsys.readouterr().err
    )


def test_plan_without_model_still_prints_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "plan",
                "--config",
                "configs/tiny-mono.yaml",
                "--set",
                f"model.path={tmp_path / 'none'}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "both-0" in out and "KV budget: unknown" in out and "config.json not found" in out


def test_config_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--config", "configs/tiny-1p1d.yaml", "--set", "transfer.backend=nixel"]) == 2
    )
    assert "Did you mean 'nixl'" in capsys.readouterr().err
    assert main(["worker", "--config", "configs/tiny-1p1d.yaml", "--role", "both"]) == 2
    assert "role 'both' is not in this config's roles" in capsys.readouterr().err
    assert (
        main(["worker", "--config", "configs/tiny-1p1d.yaml", "--role", "decode", "--replica", "1"])
        == 2
    )
    assert "--replica 1 is out of range" in capsys.readouterr().err


def test_slurm_launch_outside_an_allocation_says_how_to_submit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert (
        main(["launch", "--config", "configs/tiny-1p1d.yaml", "--set", "launcher.kind=slurm"]) == 2
    )
    assert "submit with deploy/slurm/submit.sh" in capsys.readouterr().err


def test_eval_and_bench_validate_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://127.0.0.1:9", "--min-accuracy", "1.5"]) == 2
    assert "--min-accuracy must be within 0..1" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--output-len", "0"]) == 2
    assert "--output-len must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--range-ratio", "1"]) == 2
    assert "--range-ratio must be in [0, 1)" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--num-requests", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_eval_defaults_from_config_eval_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.tasks import arith
    from tests.orchestrator.openai_double import DoubleState, OpenAIDouble

    data = yaml.safe_load((REPO_ROOT / "configs/tiny-1p1d.yaml").read_text())
    data["eval"] = {"samples": 3, "concurrency": 1, "min_accuracy": 0.5, "seed": 11}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    problems = arith.make_problems(3, 11)
    state = DoubleState(answers={p.prompt: p.answer for p in problems})
    with OpenAIDouble(state) as url:
        assert main(["eval", "--url", url, "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == "accuracy: 1.000 (3/3)"
    assert [b["prompt"] for b in state.requests] == [p.prompt for p in problems]


def test_serve_refuses_a_missing_model_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "serve",
            "--model",
            str(tmp_path / "missing"),
            "--set",
            f"launcher.log_dir={tmp_path / 'logs'}",
        ]
    )
    assert rc == 2
    assert "config.json not found" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()
