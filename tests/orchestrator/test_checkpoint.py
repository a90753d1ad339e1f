"""The launcher's checkpoint checks: each problem is one line naming the file and field, found
before any process starts; models by name from a fake Hugging Face cache."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator.checkpoint import check_checkpoint
from orchestrator.cli import main
from orchestrator.config import REPO_ROOT, ClusterConfigError, load_config
from orchestrator.hub import HubModelError, hub_cache_dir, looks_like_repo_id, resolve_repo_id
from orchestrator.plan import preflight

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def copy_model(tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(EMBEDDED, out)
    return out


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def fake_hub(root: Path, repo: str, model: Path, refs: bool = True) -> Path:
    """A hub cache entry for `repo` whose snapshot links to `model`'s files (as the hub does)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in model.iterdir():
        (snap / f.name).symlink_to(f)
    if refs:
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text(COMMIT)
    return snap


def _missing_field(p: Path) -> None:
    edit_config(p, hidden_size=None)


def _bad_json(p: Path) -> None:
    (p / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],')


def _unsupported(p: Path) -> None:
    edit_config(p, architectures=["BertModel"])


def _not_int(p: Path) -> None:
    edit_config(p, num_hidden_layers="four")


def _bin_only(p: Path) -> None:
    (p / "model.safetensors").rename(p / "pytorch_model.bin")


def _corrupt_weights(p: Path) -> None:
    (p / "model.safetensors").write_bytes(b"\xff" * 64)


def _truncated_weights(p: Path) -> None:
    f = p / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a copy that stopped half-way


def _missing_shard(p: Path) -> None:
    (p / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))


def _slow_tokenizer_only(p: Path) -> None:
    (p / "tokenizer.json").unlink()
    (p / "tokenizer.model").write_bytes(b"sentencepiece")


def _corrupt_tokenizer(p: Path) -> None:
    (p / "tokenizer.json").write_text('{"version": "1.0", "model": 7}')


def _broken_chat_template(p: Path) -> None:
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    (p / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% if %}"}))


def _chat_template_not_text(p: Path) -> None:
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    (p / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": 5}))


def _broken_chat_template_file(p: Path) -> None:
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    (p / "chat_template.jinja").write_text("{{ messages[0] }\n")


CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("missing field", _missing_field, "config.json: required field 'hidden_size' is missing"),
    ("bad json", _bad_json, "config.json: not valid JSON"),
    ("unsupported", _unsupported, "config.json: architectures=['BertModel'] is not supported"),
    ("not an int", _not_int, "config.json: num_hidden_layers must be a positive integer"),
    ("bin only", _bin_only, "no model.safetensors or model.safetensors.index.json (it has "
                            "pytorch_model.bin)"),
    ("corrupt weights", _corrupt_weights, "model.safetensors: not a safetensors file"),
    ("truncated weights", _truncated_weights, "model.safetensors: truncated: its header's "
                                              "tensors need"),
    ("missing shard", _missing_shard, "model.safetensors.index.json lists 1 shards that are "
                                      "absent (e.g. model-00002-of-00002.safetensors)"),
    ("slow tokenizer", _slow_tokenizer_only, "has tokenizer.model but no tokenizer.json"),
    ("corrupt tokenizer", _corrupt_tokenizer, "tokenizer.json: the tokenizers library cannot "
                                              "read it"),
    ("broken chat template", _broken_chat_template, "tokenizer_config.json: its chat_template "
                                                    "is not a valid Jinja template (line 1: "),
    ("chat template not text", _chat_template_not_text, "tokenizer_config.json: chat_template "
                                                        "must be a string"),
    ("broken chat_template.jinja", _broken_chat_template_file, "chat_template.jinja: its "
                                                               "chat_template is not a valid"),
]


@pytest.mark.parametrize(("breaks", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_checkpoint_problem_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], breaks: Callable[[Path], None],
        message: str) -> None:
    model = copy_model(tmp_path)
    breaks(model)
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--set", f"launcher.log_dir={logs}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert "gateway.model_path" not in err  # not a key a user sets
    assert not logs.exists()  # nothing started


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft"])
def test_a_missing_drafter_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str) -> None:
    model = copy_model(tmp_path)
    cluster = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml",
                          [f"model.path={model}", f"speculative.method={method}"])
    assert preflight(cluster) == []  # the embedded model ships all three drafters
    shutil.rmtree(model / method)
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--set", f"speculative.method={method}",
                 "--set", f"launcher.log_dir={logs}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: speculative.model: ") and err.count("\n") == 1, err
    assert f"{model / method} has no config.json" in err
    assert not logs.exists()  # nothing started


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft"])
def test_a_truncated_drafter_is_one_line_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str) -> None:
    model = copy_model(tmp_path)
    _truncated_weights(model / method)
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--set", f"speculative.method={method}",
                 "--set", f"launcher.log_dir={logs}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {model / method / 'model.safetensors'}: truncated"), err
    assert not logs.exists()  # nothing started


def test_a_worker_refusing_its_drafter_exits_with_one_line(tmp_path: Path) -> None:
    """The same refusal from the worker itself (`tandem worker` started by hand): its
    ConfigError is one line on stderr and exit status 2, not a traceback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "worker", "--config", "configs/tiny-1p1d.yaml",
         "--role", "decode", "--port", str(port), "--set", "speculative.method=eagle",
         "--set", f"speculative.model={tmp_path / 'nope'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: speculative.model: ") and "Traceback" not in out.stderr, \
        out.stderr


def test_dummy_weights_need_no_safetensors_and_no_tokenizer_means_token_ids(
        tmp_path: Path) -> None:
    model = copy_model(tmp_path)
    (model / "model.safetensors").unlink()
    with pytest.raises(Exception, match="no model.safetensors"):
        check_checkpoint(str(model))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (model / f).unlink()
    report = check_checkpoint(str(model), load_format="dummy")
    assert not report.has_tokenizer and report.config["architectures"] == ["Qwen3ForCausalLM"]
    cluster = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml",
                          [f"model.path={model}", "model.load_format=dummy"])
    [note] = preflight(cluster)
    assert "token-id prompts on /v1/completions only" in note


def test_hub_cache_location_honours_the_environment(tmp_path: Path) -> None:
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}) == Path("/c")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"
    assert looks_like_repo_id("Qwen/Qwen3-0.6B") and looks_like_repo_id("org/m@v1.0")
    assert not looks_like_repo_id("./a/b") and not looks_like_repo_id("a/b/c")


def test_serve_resolves_a_name_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./Qwen directory shadows the name
    snap = fake_hub(tmp_path / "hf" / "hub", "Qwen/Tiny-Arith", EMBEDDED)
    assert resolve_repo_id("Qwen/Tiny-Arith") == snap
    assert resolve_repo_id(f"Qwen/Tiny-Arith@{COMMIT}") == snap
    assert main(["plan", "--config", "configs/tiny-1p1d.yaml", "--set",
                 "model.path=Qwen/Tiny-Arith"]) == 0
    out = capsys.readouterr().out
    assert f"model: {snap} (served as Qwen/Tiny-Arith)" in out
    from orchestrator.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "--model", "Qwen/Tiny-Arith",
                                      "--served-model-name", "arith"])
    cluster = serve_config(args)
    assert cluster.model.path == str(snap) and cluster.served_model_name == "arith"
    args = build_parser().parse_args(["serve", "--model", "Qwen/Tiny-Arith"])
    assert serve_config(args).served_model_name == "Qwen/Tiny-Arith"


def test_a_name_missing_from_the_cache_says_where_it_looked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--model", "Qwen/Qwen3-0.6B",
                 "--set", f"launcher.log_dir={tmp_path / 'logs'}"]) == 2
    err = capsys.readouterr().err
    looked = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-0.6B"
    assert err.count("\n") == 1 and f"looked for {looked}" in err
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in err
    # refs/ lost (a copied cache) with two snapshots: which one is ambiguous
    snap = fake_hub(tmp_path / "hf" / "hub", "org/two", EMBEDDED, refs=False)
    with pytest.raises(HubModelError, match="no refs/v2 and 1 snapshots") as one:
        resolve_repo_id("org/two@v2")
    assert "org/two@COMMIT" in str(one.value)
    assert resolve_repo_id("org/two") == snap  # the only snapshot
    (snap.parent / ("f" * 40)).mkdir()
    with pytest.raises(HubModelError, match="2 snapshots"):
        resolve_repo_id("org/two")


@pytest.mark.parametrize("changes, says", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "mxfp4"}},
     "quantization_config.quant_method 'mxfp4' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
     "rope type 'longrope' is not supported"),
    ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads (3)"),
])
def test_the_familys_own_fields_are_one_line_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object], says: str
) -> None:
    """Fields only the worker's parser reads (worker/arch, no torch) are checked by serve's
    preflight and by plan, as the worker would read them."""
    p = copy_model(tmp_path)
    edit_config(p, **changes)
    with pytest.raises(ClusterConfigError, match=re.escape(says)):
        check_checkpoint(str(p))
    assert main(["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={p}"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_slurm_and_ray_refuse_the_checkpoint_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """submit.sh's first query and the Ray launcher run the same preflight as `tandem serve`:
    the family's parser refuses config.json before sbatch or a Ray connection."""
    from orchestrator.launch import slurm

    p = copy_model(tmp_path)
    edit_config(p, hidden_act="gelu")
    config = ["--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={p}"]
    assert slurm.main(["nodes", *config]) == 2
    err = capsys.readouterr().err.strip()
    assert "hidden_act 'gelu' is not supported" in err and len(err.splitlines()) == 1, err
    logs = tmp_path / "logs"
    ray = ["launcher.kind=ray", "roles.prefill.base_port=51100", "roles.decode.base_port=51200",
           f"launcher.log_dir={logs}"]
    assert main(["launch", *config, *(a for s in ray for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert "hidden_act 'gelu' is not supported" in err and len(err.splitlines()) == 1, err
    assert not logs.exists()


@pytest.mark.parametrize("method, sub, changes, says", [
    ("draft", "draft", {"num_key_value_heads": 1},
     "cannot share the target's KV pages: num_key_value_heads 1 != the target's 2"),
    ("draft", "draft", {"max_position_embeddings": 256},
     "max_position_embeddings 256 < the target's context 512"),
    ("draft", "draft", {"architectures": ["Qwen3NextForCausalLM"]}, "cannot draft"),
    ("eagle", "eagle", {"model_type": "mtp"}, "is not an eagle head (model_type 'mtp'"),
    ("eagle", "eagle", {"hidden_size": 64}, "hidden_size 64 != the target's 128"),
    ("mtp", "mtp", {"head_dim": 16}, "head_dim 16 != the target's 32"),
])
def test_a_drafter_that_cannot_serve_is_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, sub: str,
    changes: dict[str, object], says: str,
) -> None:
    """The worker's drafter checks (worker/arch/drafter.py) run in serve's preflight and in
    plan: a head or draft model that does not fit the target never reaches a worker."""
    model = copy_model(tmp_path)
    edit_config(model / sub, **changes)
    logs = tmp_path / "logs"
    assert main(["serve", "--model", str(model), "--set", f"speculative.method={method}",
                 "--set", f"launcher.log_dir={logs}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: speculative.") and err.count("\n") == 1, err
    assert says in err
    assert not logs.exists()
    assert main(["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={model}",
                 "--set", f"speculative.method={method}"]) == 2
    assert says in capsys.readouterr().err


def test_a_drafter_with_attention_dp_is_refused_before_anything_starts(tmp_path: Path) -> None:
    cluster = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml",
                          ["speculative.method=eagle", "roles.decode.parallel.dp_size=2"])
    with pytest.raises(ClusterConfigError, match="cannot run with parallel.dp_size=2"):
        preflight(cluster)


def test_preflight_says_the_models_sampling_defaults_and_refuses_bad_ones(
        tmp_path: Path) -> None:
    model = copy_model(tmp_path)
    gen = model / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "temperature": 0.6, "top_k": 20}))
    cluster = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml", [f"model.path={model}"])
    [note] = preflight(cluster)
    assert "sampling a request leaves out: temperature=0.6, top_k=20" in note
    off = load_config(REPO_ROOT / "configs" / "tiny-1p1d.yaml",
                      [f"model.path={model}", "gateway.generation_config=none"])
    assert preflight(off) == []
    gen.write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ClusterConfigError, match=r"generation_config.json: top_p must be a "
                       r"number in \(0, 1\], got 0; fix it, or set gateway.generation_config"):
        preflight(cluster)


_TOKENIZER_CASES = [c for c in CASES if "chat template" in c[0] or "chat_template" in c[0]]


@pytest.mark.parametrize(("breaks", "message"), [c[1:] for c in _TOKENIZER_CASES],
                         ids=[c[0] for c in _TOKENIZER_CASES])
def test_the_gateway_command_refuses_a_broken_chat_template_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], breaks: Callable[[Path], None],
        message: str) -> None:
    """`tandem gateway` run by itself (past serve's preflight) loads the template as the
    preflight does: the same line, not jinja2's traceback."""
    model = copy_model(tmp_path)
    breaks(model)
    assert main(["gateway", "--config", "configs/tiny-mono.yaml", "--set", f"model.path={model}",
                 "--set", "roles.both.base_port=50999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_the_gateway_command_refuses_a_bad_generation_config_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem gateway` (what Slurm, Ray and Kubernetes run) reads generation_config.json when
    it starts, past the launchers' preflight: one line, not a traceback."""
    model = copy_model(tmp_path)
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    assert main(["gateway", "--config", "configs/tiny-mono.yaml", "--set", f"model.path={model}",
                 "--set", "roles.both.base_port=50999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "generation_config.json: top_p must be a number in (0, 1], got 0" in err


def test_a_worker_refusing_weights_wider_than_config_json_exits_with_one_line(
        tmp_path: Path) -> None:
    """config.json's intermediate_size smaller than the checkpoint's MLP weights: the worker's
    WeightShapeError (a ModelLoadError) is one line naming the tensor, exit status 2."""
    import socket
    import subprocess
    import sys

    model = copy_model(tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    edit_config(model, intermediate_size=cfg["intermediate_size"] // 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "worker", "--config", "configs/tiny-mono.yaml",
         "--role", "both", "--port", str(port), "--set", f"model.path={model}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint tensor model.layers.0.mlp.down_proj.weight: ")
    assert "does config.json match the weights?" in last, last
    assert "Traceback" not in out.stderr, out.stderr


def test_mtp_on_a_checkpoint_that_declares_mtp_layers_without_their_weights_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """transformers' save_pretrained of a DeepSeek-V3 keeps num_nextn_predict_layers in
    config.json and writes no MTP tensors: speculative.method=mtp has nothing to draft with,
    which plan and serve say before a worker starts (and with only the methods it can run)."""
    from tests.worker.deepseek_model import build_deepseek_checkpoint

    model = tmp_path / "deepseek"
    build_deepseek_checkpoint(model, num_nextn_predict_layers=1)
    capsys.readouterr()  # transformers' progress bars
    assert main(["plan", "--model", str(model), "--dtype", "float32",
                 "--set", "speculative.method=mtp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: speculative.method=mtp: ") and err.count("\n") == 1, err
    assert "model.layers.3.*" in err and err.rstrip().endswith("speculative.method ngram"), err
    build_deepseek_checkpoint(model, num_nextn_predict_layers=1, mtp=True)  # with them: fine
    assert main(["plan", "--model", str(model), "--dtype", "float32",
                 "--set", "speculative.method=mtp"]) == 0
