"""`--kv-cache-dtype` on serve / worker / launch / plan, and `tandem plan`'s KV bytes per page
and weight bytes for the chosen dtypes (FP8 KV pages; FP8 checkpoints on CUDA and on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.make_fp8 import convert
from orchestrator.cli import build_parser, main, serve_config
from orchestrator.config import REPO_ROOT

EMBEDDED = REPO_ROOT / "models" / "tandem-arith"


def _row(out: str, role: str) -> list[str]:
    return next(
        line.split() for line in out.splitlines() if line.split()[:1] == [role] and "MiB" in line
    )


def test_kv_cache_dtype_flag_sets_the_config_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = serve_config(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"]))
    assert c.cache.kv_cache_dtype == "fp8_e4m3"
    assert c.roles.decode is not None and c.roles.decode.cache is not None
    assert (
        c.roles.decode.cache.kv_cache_dtype == "fp8_e4m3"
    )  # the role's partial cache section inherits it
    for cmd in (["worker", "--role", "decode"], ["launch"]):
        args = build_parser().parse_args(
            [*cmd, "--config", "configs/tiny-1p1d.yaml", "--kv-cache-dtype", "fp8_e4m3"]
        )
        assert args.kv_cache_dtype == "fp8_e4m3"
    assert main(["serve", "--kv-cache-dtype", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    assert (
        main(["plan", "--config", "configs/tiny-1p1d.yaml", "--set", "cache.kv_cache_dtype=int4"])
        == 2
    )
    assert "cache.kv_cache_dtype" in capsys.readouterr().err


def test_plan_shows_kv_page_and_weight_bytes_for_the_dtypes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--config", "configs/tiny-1p1d.yaml"]) == 0
    auto = capsys.readouterr().out
    assert main(["plan", "--config", "configs/tiny-1p1d.yaml", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    f8 = capsys.readouterr().out
    # 4 layers x K,V x 2 kv heads x 16 tokens x 32 dims: 4 bytes each, or 1 in FP8.
    assert _row(auto, "decode")[3:6] == ["32768", "32.0", "MiB"] and "float32" in _row(
        auto, "decode"
    )
    assert _row(f8, "decode")[3:6] == ["8192", "8.0", "MiB"] and "float8_e4m3fn" in _row(
        f8, "decode"
    )
    # The embedded model's 1,000,832 float32 parameters, from its safetensors header.
    assert _row(f8, "prefill")[7:9] == ["3.8", "MiB"]

    convert(EMBEDDED, tmp_path / "fp8")
    assert (
        main(
            [
                "plan",
                "--config",
                "configs/tiny-1p1d.yaml",
                "--set",
                f"model.path={tmp_path / 'fp8'}",
                "--set",
                "roles.prefill.parallel.device=cuda",
                "--set",
                "roles.decode.parallel.device=cpu",
                "--gpus",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    cuda, cpu = _row(out, "prefill"), _row(out, "decode")
    assert "float8_e4m3fn" in cuda[-3:] and cuda[7:9] == [
        "1.0",
        "MiB",
    ]  # linears 1 byte (+ scales) on CUDA
    assert cpu[7:9] == ["3.8", "MiB"] and cpu[-1] == "float32"  # dequantized at load on the CPU


def test_plan_of_a_kv_cache_only_checkpoint_holds_the_weights_unquantized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llm-compressor's KV-cache-only config (compressed-tensors, no weight groups): on CUDA the
    plan said 'float8_e4m3fn + float32' for weights that hold no FP8 tensor."""
    import json
    import shutil

    from tests.worker.test_fp8_kv import LLM_COMPRESSOR_KV

    path = tmp_path / "ct"
    shutil.copytree(EMBEDDED, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = LLM_COMPRESSOR_KV
    (path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--config", "configs/tiny-mono.yaml", "--model", str(path),
            "--set", "roles.both.parallel.device=cuda", "--gpus", "1"]
    assert main(argv) == 0
    both = _row(capsys.readouterr().out, "both")
    assert both[7:] == ["3.8", "MiB", "float32"]


def test_plan_on_cuda_of_blocks_the_fp8_kernels_do_not_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 96x96-block copy: the Triton GEMM steps K one scale block at a time (tl.arange needs a
    power of two), so a CUDA worker dequantizes it at load; the plan said float8_e4m3fn."""
    from worker.arch.fp8_config import BlockFp8Config

    assert not BlockFp8Config(96, 96).gpu_kernels_take and BlockFp8Config(128, 64).gpu_kernels_take
    convert(EMBEDDED, tmp_path / "b96", (96, 96))
    argv = ["plan", "--config", "configs/tiny-mono.yaml", "--model", str(tmp_path / "b96"),
            "--set", "roles.both.parallel.device=cuda", "--gpus", "1"]
    assert main(argv) == 0
    assert _row(capsys.readouterr().out, "both")[7:] == ["3.8", "MiB", "float32"]


def test_plan_on_cuda_of_a_qwen3_next_fp8_copy_counts_what_it_dequantizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-Next builds only its shared experts' MLPs as FP8 linears (llama.MLP); its gated
    attention, linear attention and routed experts take the model dtype, so a CUDA worker
    dequantizes those at load. The plan counted every e4m3 tensor at one byte."""
    import json
    import struct

    from tests.worker.qwen3_next_model import build_qwen3_next_checkpoint

    src, dst = tmp_path / "src", tmp_path / "fp8"
    build_qwen3_next_checkpoint(src, seed=3)
    convert(src, dst, (32, 32))  # a K block the CUDA kernels run (GPU_BLOCK_K)
    raw = (dst / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    want = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in entry["shape"]:
            n *= d
        fp8_linear = ".shared_expert." in name
        if name.endswith("_scale_inv"):
            want += 4 * n if fp8_linear else 0
        else:
            want += n if fp8_linear and entry["dtype"] == "F8_E4M3" else 2 * n
    argv = ["plan", "--config", "configs/tiny-mono.yaml", "--model", str(dst), "--dtype",
            "bfloat16", "--set", "roles.both.parallel.device=cuda", "--gpus", "1"]
    assert main(argv) == 0
    size = _row(capsys.readouterr().out, "both")[7:9]
    assert f"{float(size[0]):.1f}" == f"{want / 1024:.1f}" and size[1] == "KiB", (size, want)


def test_plan_estimate_of_an_fp8_moe_shape_directory_holds_the_experts_unquantized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json-only directory of an FP8 Qwen3-MoE (planning a GPU deployment): a CUDA
    worker dequantizes the routed experts at load (no FP8 MoE kernels), but the estimate counted
    them at one byte: 1.3 MiB against the 2.0 MiB the checkpoint's own headers give."""
    import json
    import shutil

    import torch
    import transformers

    src = tmp_path / "moe"
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, max_position_embeddings=512,
        tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(src)
    convert(src, tmp_path / "fp8")
    shape = tmp_path / "shape"
    shape.mkdir()
    shutil.copy(tmp_path / "fp8" / "config.json", shape / "config.json")
    rows = []
    for path in (tmp_path / "fp8", shape):
        argv = ["plan", "--config", "configs/tiny-mono.yaml", "--model", str(path),
                "--set", "model.load_format=dummy", "--set", "roles.both.parallel.device=cuda",
                "--gpus", "1"]
        assert main(argv) == 0
        rows.append(_row(capsys.readouterr().out, "both"))
    assert rows[0][7:9] == ["2.0", "MiB"] and rows[1][7:9] == ["2.0", "MiB"], rows
    assert json.loads((shape / "config.json").read_text())["quantization_config"]


def test_vllm_quantization_flag_names_the_fp8_copy_script(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM's --quantization fp8 (quantize a bf16 model at load) said only 'unrecognized
    argument; see tandem serve --help'; Tandem serves FP8 checkpoints, so the line names the
    script that makes one."""
    for argv in (["--quantization", "fp8"], ["--quantization=fp8"], ["-q", "fp8"]):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert "python -m models.make_fp8 SRC DST" in err and err.count("\n") == 1, err
