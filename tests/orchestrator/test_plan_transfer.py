"""plan.check_layout and transfer.backend: cuda_ipc moves KV between GPU pools of one host, so
a PD role that runs on the CPU is refused in one line before anything starts (it used to start
the workers, and the prefill worker died with a TransferConfigError traceback)."""

from __future__ import annotations

import pytest

from orchestrator.config import config_from_dict
from orchestrator.devices import CudaStatus
from orchestrator.plan import LayoutError, check_layout

CPU = CudaStatus(gpus=0, torch_cuda="")
GPU = CudaStatus(gpus=2, torch_cuda="13.0")


def _pd(decode_device: str = "auto") -> dict:
    return {"transfer": {"backend": "cuda_ipc"},
            "roles": {"prefill": {"count": 1},
                      "decode": {"count": 1, "parallel": {"device": decode_device}}}}


def test_cuda_ipc_with_a_cpu_role_is_refused_naming_the_field() -> None:
    with pytest.raises(LayoutError, match=r"^transfer\.backend=cuda_ipc: roles\.prefill runs "
                                          r"on cpu.*mooncake or nixl"):
        check_layout(config_from_dict(_pd()), None, CPU)
    with pytest.raises(LayoutError,
                       match=r"^transfer\.backend=cuda_ipc: roles\.decode runs on cpu"):
        check_layout(config_from_dict(_pd("cpu")), None, GPU)


def test_cuda_ipc_on_gpus_and_mono_on_the_cpu_pass() -> None:
    check_layout(config_from_dict(_pd()), None, GPU)
    mono = {"transfer": {"backend": "cuda_ipc"}, "roles": {"both": {"count": 1}}}
    check_layout(config_from_dict(mono), None, CPU)  # no KV transfer at all


def _libcuda() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libcuda(), reason="a machine without the CUDA driver")
def test_a_worker_started_by_hand_with_cuda_ipc_on_the_cpu_exits_2_in_one_line() -> None:
    """`tandem worker` skips plan's rules: the backend's own refusal (no CUDA driver) is its
    one line, status 2."""
    import subprocess
    import sys
    from pathlib import Path

    from orchestrator.launch.ports import choose_port

    repo = Path(__file__).resolve().parents[2]
    args = ["worker", "--config", str(repo / "configs" / "tiny-1p1d.yaml"), "--role", "prefill",
            "--set", "transfer.backend=cuda_ipc", "--set", "roles.prefill.parallel.device=cpu",
            "--port", str(choose_port("127.0.0.1"))]
    code = f"from orchestrator.cli import main; raise SystemExit(main({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "transfer.backend is cuda_ipc" in errors[0], proc.stderr[-2000:]


def _hf(**extra: object) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_hidden_layers": 3, "intermediate_size": 48, "num_local_experts": 4,
            "num_experts_per_tok": 2, "max_position_embeddings": 384, "vocab_size": 128,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **extra}


def test_window_and_recurrent_models_on_multi_rank_workers_are_refused_by_plan() -> None:
    """The worker's rule (worker/cache_layout.py kv_shape), before any process starts: it used
    to pass plan and stop the prefill worker after the launch."""
    hetero = config_from_dict({"roles": {"prefill": {"count": 1, "parallel": {"tp_size": 2}},
                                         "decode": {"count": 1}}})
    with pytest.raises(LayoutError, match=r"^roles\.prefill\.parallel: a model with "
                                          r"sliding-window layers \(2 of 3, window 12\)"):
        check_layout(hetero, _hf(), CPU)
    q3n = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 4, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 384,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "vocab_size": 128,
           "layer_types": ["linear_attention", "full_attention"] * 2}
    dp = config_from_dict({"roles": {"both": {"count": 1, "parallel": {"dp_size": 2}}}})
    with pytest.raises(LayoutError, match=r"^roles\.both\.parallel: a model with recurrent "
                                          r"layers \(2 of 4\)"):
        check_layout(dp, q3n, CPU)
    # one rank each: fine; a window as long as the context never slides: plain pages, fine
    check_layout(config_from_dict({"roles": {"prefill": {"count": 1}, "decode": {"count": 1}}}),
                 _hf(), CPU)
    check_layout(hetero, _hf(sliding_window=384), CPU)
