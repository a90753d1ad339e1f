"""The layout planner: rank maps of multi-node layouts and every rule's rejection, table-driven."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli import main
from orchestrator.config import ClusterConfig, config_from_dict
from orchestrator.devices import cuda_status
from orchestrator.plan import LayoutError, check_layout
from orchestrator.plan_text import format_plan
from orchestrator.rank_map import num_nodes, plan_processes
from orchestrator.worker_config import worker_config

# Shapes of real checkpoints' config.json (only the keys the planner reads).
DENSE_8B = {
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "torch_dtype": "bfloat16",
}
MOE_30B = {
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "torch_dtype": "bfloat16",
}
# GPT-OSS-like: sliding layers (window 128) beside full ones, so window rings and bounded replay.
WINDOWED = {**DENSE_8B, "model_type": "gpt_oss", "sliding_window": 128,
            "max_position_embeddings": 4096,
            "layer_types": ["sliding_attention", "full_attention"] * 18}


def cluster(prefill: dict[str, Any], decode: dict[str, Any] | None = None, kind: str = "slurm",
            gpus: int = 8, scheduler: dict[str, Any] | None = None) -> ClusterConfig:
    roles = {
        "prefill": {"base_port": 30000, **prefill},
        "decode": {"base_port": 31000, **(decode or {})},
    }
    return config_from_dict(
        {
            "roles": roles,
            "launcher": {"kind": kind, "gpus_per_node": gpus},
            "scheduler": scheduler or {"max_num_seqs": 64, "chunked_prefill_size": 512},
        }
    )


def gpu(**parallel: Any) -> dict[str, Any]:
    return {"parallel": {"device": "cuda", **parallel}}


def test_tp16_over_two_8_gpu_nodes() -> None:
    c = cluster(gpu(tp_size=16, nnodes=2), gpu(tp_size=8))
    check_layout(c, DENSE_8B)
    rows = [r for r in plan_processes(c) if r.role == "prefill"]
    assert len(rows) == 16
    assert [(r.node, r.device, r.tp_rank) for r in rows[:2]] == [(0, "cuda:0", 0), (0, "cuda:1", 1)]
    assert [(r.node, r.device, r.tp_rank, r.node_rank) for r in rows[8:10]] == [
        (1, "cuda:0", 8, 1),
        (1, "cuda:1", 9, 1),
    ]
    # one launch per node
    assert [r.name for r in rows if r.starts_node] == ["prefill-0", "prefill-0.r8"]
    assert rows[0].port == 30000 and all(r.port == 0 for r in rows[1:])
    dec = [r for r in plan_processes(c) if r.role == "decode"]
    assert {r.node for r in dec} == {2} and [r.device for r in dec] == [
        f"cuda:{i}" for i in range(8)
    ]
    assert num_nodes(c) == 3
    # Node 1 of the replica rendezvouses at node 0: host and port + 1.
    assert worker_config(c, "prefill", 0).parallel.dist_init_addr == "tcp://127.0.0.1:30001"
    assert worker_config(c, "prefill", 0).parallel.nnodes == 2


def test_tp8_dp2_ep16_over_two_nodes() -> None:
    c = cluster(gpu(tp_size=8, dp_size=2, ep_size=16, nnodes=2, all2all_backend="deepep"),
                gpu(tp_size=8, dp_size=2, ep_size=16, nnodes=2, all2all_backend="deepep"),
                scheduler={"max_num_seqs": 64, "chunked_prefill_size": 128})
    check_layout(c, MOE_30B)
    rows = [r for r in plan_processes(c) if r.role == "prefill"]
    assert [
        (r.rank, r.node, r.tp_rank, r.dp_rank, r.ep_rank)
        for r in (rows[0], rows[7], rows[8], rows[15])
    ] == [(0, 0, 0, 0, 0), (7, 0, 7, 0, 7), (8, 1, 0, 1, 8), (15, 1, 7, 1, 15)]
    assert {r.node for r in plan_processes(c) if r.role == "decode"} == {2, 3}
    assert worker_config(c, "decode", 0).parallel.ep_size == 16

EIGHT_GPUS = cuda_status(gpus=8)  # planned as for an 8-GPU node (this machine may have none)


def test_local_layout_shares_one_machine() -> None:
    c = cluster(gpu(tp_size=2), gpu(tp_size=4), kind="local")
    check_layout(c, DENSE_8B, EIGHT_GPUS)
    assert [(r.node, r.device) for r in plan_processes(c, EIGHT_GPUS) if r.role != "gateway"] == [
        (0, "cuda:0"), (0, "cuda:1"), (0, "cuda:2"), (0, "cuda:3"), (0, "cuda:4"), (0, "cuda:5")]
    assert num_nodes(c) == 1


# (prefill parallel, decode parallel, launcher kind, scheduler, model, the message's key words)
REJECTIONS: list[
    tuple[str, dict[str, Any], str, dict[str, Any] | None, dict[str, Any] | None, str]
] = [
    ("world != nnodes * procs_per_node", gpu(tp_size=8, nnodes=2, procs_per_node=8), "slurm",
     None, None,
     "world size nnodes*procs_per_node = 2*8 = 16 but attention tp_size*dp_size = 8*1 = 8"),
    ("world not split over nodes", gpu(tp_size=6, nnodes=4), "slurm", None, None,
     "tp_size*dp_size = 6 ranks do not split evenly over nnodes=4"),
    ("more ranks per node than GPUs", gpu(tp_size=16), "slurm", None, None,
     "16 ranks per node but launcher.gpus_per_node=8; raise nnodes to 2"),
    ("local GPUs oversubscribed", gpu(tp_size=8), "local", None, None,
     "the cuda roles need 9 GPUs on this machine but launcher.gpus_per_node=8"),
    ("multi-node outside slurm", gpu(tp_size=16, nnodes=2), "ray", None, None,
     "nnodes=2: launcher.kind=ray runs each worker on one node"),
    ("heads", gpu(tp_size=3), "slurm", None, DENSE_8B,
     "tp_size=3 must divide num_attention_heads=32"),
    ("kv heads", gpu(tp_size=4), "slurm", None,
     {**DENSE_8B, "num_attention_heads": 12, "num_key_value_heads": 6},
     "tp_size=4 must divide num_key_value_heads=6 or be a multiple of it"),
    ("intermediate", gpu(tp_size=8), "slurm", None, {**DENSE_8B, "intermediate_size": 12300},
     "intermediate_size=12300 must be divisible by tp_size=8"),
    ("moe intermediate", gpu(tp_size=8), "slurm", None, {**MOE_30B, "moe_intermediate_size": 100},
     "moe_intermediate_size=100 must be divisible by tp_size*dp_size=8 when experts are "
     "TP-sharded"),
    ("experts", gpu(tp_size=8, ep_size=8), "slurm", None, {**MOE_30B, "num_experts": 60},
     "ep_size=8 must divide the model's 60 experts"),
    ("ep on a dense model", gpu(tp_size=8, ep_size=8), "slurm", None, DENSE_8B,
     "ep_size=8 but the model has no experts (dense)"),
    ("ep above world", gpu(tp_size=4, ep_size=8), "slurm", None, None,
     "ep_size=8 exceeds the world tp_size*dp_size=4: EP must be <= world"),
    ("ep neither 1 nor world", gpu(tp_size=8, ep_size=4), "slurm", None, None,
     "ep_size=4: the engine runs MoE with ep_size 1 (TP-sharded experts) or ep_size = world = 8"),
    ("deepep without ep", gpu(tp_size=8, all2all_backend="deepep"), "slurm", None, None,
     "all2all_backend=deepep needs expert parallelism (ep_size > 1)"),
    ("batch above deepep capacity", gpu(tp_size=8, ep_size=8, all2all_backend="deepep"), "slurm",
     None, None,
     "a step of up to 512 tokens per rank (scheduler.chunked_prefill_size) exceeds DeepEP's "
     "per-GPU capacity roles.prefill.parallel.deepep_max_tokens_per_rank=128; such a batch is "
     "refused, not truncated"),
    ("step budget below a window", gpu(), "slurm",
     {"max_num_seqs": 64, "chunked_prefill_size": 128}, WINDOWED,
     "scheduler.chunked_prefill_size (128) must be at least the model's sliding window plus one "
     "page (128 + 16)"),
    ("mixed-step budget below a window", gpu(), "slurm",
     {"max_num_seqs": 64, "chunked_prefill_size": 512, "mixed_step_tokens": 96}, WINDOWED,
     "scheduler.mixed_step_tokens (96) must be at least the model's sliding window plus one page"),
    ("dist_init_addr off node 0", gpu(tp_size=16, nnodes=2, dist_init_addr="tcp://10.0.0.9:29500"),
     "slurm", None, None,
     "dist_init_addr='tcp://10.0.0.9:29500' is not on replica 0's node 0 (127.0.0.1)"),
    ("dist_init_addr not tcp", gpu(tp_size=16, nnodes=2, dist_init_addr="10.0.0.9:29500"),
     "slurm", None, None, "must be tcp://HOST:PORT of the replica's node 0"),
]


@pytest.mark.parametrize(("prefill", "kind", "sched", "hf", "message"),
                         [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_every_rule_rejects_with_its_message(
    prefill: dict[str, Any],
    kind: str,
    sched: dict[str, Any] | None,
    hf: dict[str, Any] | None,
    message: str,
) -> None:
    c = cluster(prefill, {"parallel": {"device": "cuda"}}, kind=kind, scheduler=sched)
    with pytest.raises(LayoutError) as err:
        check_layout(c, hf, EIGHT_GPUS)
    assert message in str(err.value)
    assert "roles" in str(err.value)  # names the field


def test_decode_deepep_capacity_counts_running_requests() -> None:
    # Decode steps carry one token per running request: max_num_seqs is what DeepEP must hold.
    ok = cluster(gpu(tp_size=8), gpu(tp_size=8, ep_size=8, all2all_backend="deepep"),
                 scheduler={"max_num_seqs": 128, "chunked_prefill_size": 4096})
    check_layout(ok, MOE_30B)
    too_big = cluster(gpu(tp_size=8), gpu(tp_size=8, ep_size=8, all2all_backend="deepep"),
                      scheduler={"max_num_seqs": 256, "chunked_prefill_size": 4096})
    with pytest.raises(LayoutError, match=r"256 tokens per rank \(scheduler.max_num_seqs\)"):
        check_layout(too_big, MOE_30B)


def test_hosts_must_match_count() -> None:
    with pytest.raises(ValueError, match="roles.prefill.hosts lists 1 hosts for count=2 replicas"):
        cluster({"count": 2, "hosts": ["n1"]})


def test_plan_cli_prints_rank_map_and_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DENSE_8B))
    args = ["plan", "--config", "configs/tiny-1p1d.yaml", "--set", f"model.path={tmp_path}",
            "--set", "launcher.kind=slurm", "--set", "launcher.gpus_per_node=8",
            "--set", "roles.prefill.parallel.device=cuda",
            "--set", "roles.prefill.parallel.tp_size=16",
            "--set", "roles.prefill.parallel.nnodes=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nodes: 3" in out
    line = next(x for x in out.splitlines() if x.startswith("prefill-0.r9 "))
    assert line.split() == [
        "prefill-0.r9", "prefill", "0", "node1", "-", "cuda:1", "1", "9/16", "0/1", "-", "9/16",
    ]
    assert main([*args, "--set", "roles.prefill.parallel.tp_size=12"]) == 2
    # 12 splits over 2
    assert "tp_size*dp_size = 12 ranks do not split evenly" not in capsys.readouterr().err
    assert main([*args, "--set", "roles.prefill.parallel.tp_size=6"]) == 2
    assert (
        "roles.prefill.parallel.tp_size=6 must divide num_attention_heads=32"
        in capsys.readouterr().err
    )
    assert format_plan  # the CLI above went through format_plan


def test_plan_takes_what_serve_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem plan --model DIR` plans what `tandem serve --model DIR` runs (the default
    config, the model and dtype flags), without a config file."""
    assert main(["plan", "--model", "models/tandem-arith", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: ") and "tandem-arith (served as tandem-arith)" in out
    assert "bfloat16" in out and "float32" not in out
