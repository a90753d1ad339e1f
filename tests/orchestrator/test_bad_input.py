"""Bad input outside HTTP: each is one line naming the field or file and the fix, with a
non-zero exit, never a traceback (the serve side of a worker's refusal, config sections in
the wrong place, flags)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from orchestrator.cli import main
from orchestrator.config import REPO_ROOT

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"


def test_serve_reports_a_workers_refusal_as_the_clusters_failure_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint only the worker can refuse (a tensor missing from a well-formed file: the
    launcher reads headers, not tensors): the worker's one line is serve's one line."""
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.0.mlp.gate_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--port", "8201",
                 "--set", f"launcher.log_dir={logs}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: cluster did not start: "), err
    assert "-0 refused to start: " in err, err
    assert f"{model / 'model.safetensors'}: checkpoint lacks 1 tensors" in err, err
    assert "model.layers.0.mlp.gate_proj.weight" in err and "(log: " in err, err


@pytest.mark.parametrize("section", ["speculative", "transfer", "model", "gateway"])
def test_a_top_level_section_under_a_role_says_it_is_top_level(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str) -> None:
    """`speculative:` under `roles.decode:` is not a typo of `scheduler`: the fix is to move it."""
    config = tmp_path / "c.yaml"
    config.write_text(f"roles:\n  prefill: {{}}\n  decode:\n    {section}:\n      x: 1\n")
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"'{section}' is a top-level section" in err and "roles.decode" in err, err
    assert "Did you mean" not in err, err
    assert main(["plan", "--set", f"roles.decode.{section}.x=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{section}' is a top-level section" in err, err
    assert f"set {section}.x instead" in err, err


@pytest.mark.parametrize("sets, says", [
    (["roles.decode.cache.page_size=32"],
     "roles.decode.cache.page_size=32 differs from roles.prefill's 16"),
    (["roles.prefill.cache.page_size=8", "roles.decode.cache.page_size=32"],
     "roles.decode.cache.page_size=32 differs from roles.prefill's 8"),
    (["roles.prefill.cache.kv_cache_dtype=fp8_e4m3"],
     "roles.decode.cache.kv_cache_dtype=auto differs from roles.prefill's fp8_e4m3"),
])
def test_prefill_and_decode_pages_that_cannot_pair_are_refused_on_load(
        capsys: pytest.CaptureFixture[str], sets: list[str], says: str) -> None:
    """Prefill writes KV into decode's pages page for page: a page size or KV dtype that
    differs between the roles was a gateway refusing the decode worker at run time (serve
    waited out ready_timeout_s); it is one line before anything starts."""
    argv = ["plan"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert "set it once in the top-level cache section" in err, err


def test_a_page_size_of_one_role_alone_is_fine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--set", "cache.page_size=32"]) == 0
    assert main(["plan", "--config", "configs/tiny-mono.yaml",
                 "--set", "roles.both.cache.page_size=32"]) == 0
    assert main(["plan", "--set", "roles.decode.cache.enable_prefix_cache=false",
                 "--set", "roles.decode.cache.num_pages=512"]) == 0  # not contract fields
    capsys.readouterr()


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_a_kv_cache_larger_than_this_machine_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    """A CPU worker's KV pool is allocated whole at start: one that cannot fit the machine's
    memory was the worker's allocator traceback in a log tail."""
    logs = tmp_path / "logs"
    assert main([command, "--set", "cache.num_pages=100000000000",
                 "--set", f"launcher.log_dir={logs}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "roles.prefill: a prefill worker's KV cache needs " in err, err
    assert "lower cache.num_pages" in err, err
    assert not logs.exists()


def test_an_unwritable_log_dir_is_one_line(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main(["serve", "--port", "8213", "--set",
                 f"launcher.log_dir={tmp_path / 'file'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"launcher.run_dir: cannot create {tmp_path / 'file' / '8213'}" in err, err


def test_a_config_file_that_is_not_text_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01roles")  # a binary file passed by mistake
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {path}: is not UTF-8 text"), err


def test_serve_refuses_an_explicit_non_local_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    """serve runs the local launcher whatever the file says; a --set asking for another one
    was silently served locally."""
    assert main(["serve", "--port", "8217", "--set", "launcher.kind=slurm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--set launcher.kind=slurm: tandem serve runs the local launcher" in err, err
    assert "tandem launch" in err, err


def test_an_override_whose_value_is_not_yaml_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--set", "roles.decode.hosts=[a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the value is not valid YAML" in err, err
