"""Qwen3-MoE against transformers, and its parallel layouts for real (gloo, two processes).

- one rank: chunked prefill + decode logits and greedy tokens equal transformers';
- EP=2 (experts split, all-to-all dispatch/combine), MoE TP=2 (experts' features split,
  all-reduce), and DP attention (each rank its own sequence) with EP=2 all give the one-rank
  logits within tolerance; an EP rank holds (and reads) only its experts;
- `all2all_backend: deepep` without DeepEP fails with a message that names the fix.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.make_tiny_moe import make_tiny_moe
from worker.config import ModelConfig, ParallelConfig
from worker.model import load_model
from worker.model.moe import MoEConfigError, SparseMoEBlock

SEQS = {
    "a": [random.Random(1).randrange(97) for _ in range(26)],
    "b": [random.Random(2).randrange(97) for _ in range(19)],
}


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("moe")
    return path, make_tiny_moe(path)


def _reference(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {r: hf(torch.tensor([s])).logits[0] for r, s in SEQS.items()}  # [L, V]


def _run(
    model, spec, seqs: dict[str, list[int]], tp_size: int = 1
) -> dict[str, list[tuple[int, torch.Tensor]]]:  # noqa: ANN001
    """Prefill every sequence in two chunks together, then decode 4 tokens each (teacher-forced)."""
    from tests.worker.conftest import PagedHarness

    harness = PagedHarness(model, spec, page_size=4, tp_size=tp_size)
    out: dict[str, list[tuple[int, torch.Tensor]]] = {r: [] for r in seqs}
    bounds = [(0, 9), (9, -4), (-4, -3), (-3, -2), (-2, -1), (-1, None)]
    for lo, hi in bounds:
        chunks = [(r, s[lo:hi] if hi is not None else s[lo:]) for r, s in seqs.items()]
        logits = harness.step(chunks)
        for (r, _), row in zip(chunks, logits, strict=True):
            out[r].append((harness.num_tokens[r] - 1, row))
    return out


def _worst(got: dict[str, list[tuple[int, torch.Tensor]]], ref: dict[str, torch.Tensor]) -> float:
    return max(
        float((row - ref[r][pos]).abs().max()) for r, rows in got.items() for pos, row in rows
    )


def test_one_rank_matches_transformers(moe_ckpt) -> None:
    path, hf = moe_ckpt
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    assert spec.architecture == "Qwen3MoeForCausalLM"
    sparse = [isinstance(layer.mlp, SparseMoEBlock) for layer in model.model.layers]
    assert sparse == [True, False, True]  # mlp_only_layers=[1]
    assert _worst(_run(model, spec, SEQS), _reference(hf)) < 1e-4


def test_greedy_matches_transformers_generate(moe_ckpt) -> None:
    from tests.worker.conftest import PagedHarness

    path, hf = moe_ckpt
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    prompt = SEQS["a"][:11]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    harness = PagedHarness(model, spec, page_size=4)
    logits = harness.step([("g", prompt)])
    got = []
    for _ in range(8):
        tok = int(logits[0].argmax())
        got.append(tok)
        logits = harness.step([("g", [tok])])
    assert got == want


def test_deepep_refused_with_the_fix(moe_ckpt) -> None:
    path, _ = moe_ckpt
    with pytest.raises(MoEConfigError, match="all2all_backend: torch"):
        load_model(ModelConfig(path=str(path)), ParallelConfig(all2all_backend="deepep"))


def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
    """Three layouts on the same two processes; each saves its logits."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = ModelConfig(path=path)
        layouts = {
            "ep2": ParallelConfig(tp_size=2, tp_rank=rank, ep_size=2),
            "moe_tp2": ParallelConfig(tp_size=2, tp_rank=rank, ep_size=1),
        }
        for name, par in layouts.items():
            model, spec = load_model(cfg, par)
            block = model.model.layers[0].mlp
            assert isinstance(block, SparseMoEBlock)
            if name == "ep2":
                assert (
                    list(block.expert_ids()) == [2 * rank, 2 * rank + 1] and block.w13.shape[0] == 2
                )
            torch.save(_run(model, spec, SEQS, tp_size=2), f"{out_dir}/{name}-{rank}.pt")
        # DP attention (tp 1, dp 2): each rank serves its own sequence;
        # the experts are shared (EP=2).
        model, spec = load_model(cfg, ParallelConfig(tp_size=1, tp_rank=0, dp_size=2, ep_size=2))
        mine = {
            "ab"[rank]: SEQS["ab"[rank]][:19]
        }  # same step count on both ranks: the all-to-alls pair up
        torch.save(_run(model, spec, mine), f"{out_dir}/dp2-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ep2_moe_tp2_and_dp_attention_equal_one_rank(moe_ckpt, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    path, hf = moe_ckpt
    one, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    ref = _run(one, spec, SEQS)  # EP=1 / TP=1 on this process
    hf_ref = _reference(hf)
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for name in ("ep2", "moe_tp2"):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            worst = max(
                float((g[1] - w[1]).abs().max())
                for r in SEQS
                for g, w in zip(got[r], ref[r], strict=True)
            )
            assert worst < 1e-4, f"{name} rank {rank}: max |logit diff| vs one rank {worst}"
            assert _worst(got, hf_ref) < 1e-4
            greedy = [int(row.argmax()) for r in SEQS for _, row in got[r]]
            assert greedy == [int(row.argmax()) for r in SEQS for _, row in ref[r]]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"dp2-{rank}.pt")
        with torch.no_grad():
            seq = SEQS["ab"[rank]][:19]
            want = {"ab"[rank]: hf(torch.tensor([seq])).logits[0]}
        assert _worst(got, want) < 1e-4


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.float32),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_grouped_linear_equals_each_row_times_its_expert(device: str, dtype: torch.dtype) -> None:
    """The grouped GEMM path (no loop over experts) against the plain per-row reference, with
    experts that get no row and rows in any order; biases gathered per row."""
    from worker.model.moe import ExpertGroups, grouped_linear

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    e, n, d_in, d_out = 6, 23, 64, 48
    w = torch.randn(e, d_out, d_in, generator=g).to(device, dtype)
    bias = torch.randn(e, d_out, generator=g).to(device, dtype)
    x = torch.randn(n, d_in, generator=g).to(device, dtype)
    ids = torch.tensor([5, 0, 5, 2, 2, 5, 0, 3] * 3, device=device)[:n]  # experts 1 and 4: none
    groups = ExpertGroups.of(ids, e)
    got = groups.unsort(grouped_linear(groups.sort(x), w, groups, bias))
    want = torch.stack([F.linear(x[i], w[ids[i]], bias[ids[i]]) for i in range(n)])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert float((got.float() - want.float()).abs().max()) < tol * float(want.abs().max())
    assert grouped_linear(x[:0], w, ExpertGroups.of(ids[:0], e)).shape == (0, d_out)
