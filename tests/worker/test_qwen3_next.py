"""Qwen3-Next (Gated DeltaNet + gated attention + shared-expert MoE) against transformers.

The model is driven directly with hand-built ForwardBatches over a KVCache with a state region
(tests/worker/qwen3_next_model.py's StateHarness plays the engine): whole prompts, the same
prompt in chunks of several sizes then greedy decode steps, batches mixing requests at
different positions, a request resumed from a copied state slot (the prefix-cache snapshot),
greedy generation against `generate`, TP=2 / EP=2 over gloo, and config errors.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from tests.worker.qwen3_next_model import StateHarness, build_qwen3_next_checkpoint
from worker.config import ModelConfig, ParallelConfig
from worker.model import ModelLoadError, load_model
from worker.model.gated_deltanet import GatedDeltaNet

VOCAB = 128


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3next")
    return path, build_qwen3_next_checkpoint(path)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def load(path: Path, **parallel: object):  # noqa: ANN201 - (CausalLM, ModelSpec)
    parallel_config = ParallelConfig(**parallel)  # type: ignore[arg-type]
    return load_model(ModelConfig(path=str(path)), parallel_config)


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [L, V]


def test_spec_names_the_recurrent_layers_and_their_state(checkpoint) -> None:
    model, spec = load(checkpoint[0])
    assert spec.architecture == "Qwen3NextForCausalLM"
    assert spec.state_layers == (0, 1, 3)
    st = spec.state_shape
    assert st is not None
    # conv: K-1 = 3 inputs of q|k|v channels (2*2*16 + 4*8 = 96); ssm: 4 value heads of [16, 8].
    assert st.conv == (3, 96) and st.ssm == (4, 16, 8) and st.ssm_dtype == torch.float32
    assert not model.supports_cuda_graphs


def test_whole_prompt_logits_match_transformers(checkpoint) -> None:
    path, hf = checkpoint
    model, spec = load(path)
    ids = prompt(90)  # longer than the chunked rule's 64-token chunk
    got = StateHarness(model, spec).step([("a", ids)], all_rows=True)
    assert float((got - hf_logits(hf, ids)).abs().max()) < 1e-4


@pytest.mark.parametrize("sizes", [(1,), (3,), (7, 2), (64,), (5, 1, 17, 3, 64)])
def test_chunked_prefill_then_decode_matches_transformers(checkpoint, sizes: tuple[int, ...]
                                                          ) -> None:
    """The prompt in chunks of the given sizes (cycled), then 6 decode steps of its own tokens."""
    path, hf = checkpoint
    model, spec = load(path)
    ids = prompt(80, seed=1)
    want = hf_logits(hf, ids)
    harness = StateHarness(model, spec)
    pos, step, worst = 0, 0, 0.0
    while pos < 74:
        n = min(sizes[step % len(sizes)], 74 - pos)
        row = harness.step([("a", ids[pos : pos + n])])[0]
        pos, step = pos + n, step + 1
        worst = max(worst, float((row - want[pos - 1]).abs().max()))
    for t in range(74, 80):  # decodes: one token each
        row = harness.step([("a", [ids[t]])])[0]
        worst = max(worst, float((row - want[t]).abs().max()))
    assert worst < 1e-4, f"chunks {sizes}: max |logit diff| {worst}"


def test_mixed_batches_of_prefill_chunks_and_decodes(checkpoint) -> None:
    """Three requests at different positions share every step: chunks next to decodes."""
    path, hf = checkpoint
    model, spec = load(path)
    seqs = {"a": prompt(40, 2), "b": prompt(23, 3), "c": prompt(31, 4)}
    want = {r: hf_logits(hf, s) for r, s in seqs.items()}
    plan = {"a": [0, 30, 31, 32, 40], "b": [0, 5, 6, 20, 21, 22, 23], "c": [0, 1, 2, 3, 31]}
    harness = StateHarness(model, spec)
    worst = 0.0
    for step in range(max(len(p) for p in plan.values()) - 1):
        chunks = [(r, seqs[r][p[step] : p[step + 1]]) for r, p in plan.items() if step + 1 < len(p)]
        rows = harness.step(chunks)
        for (r, _), row in zip(chunks, rows, strict=True):
            end = plan[r][step + 1]
            worst = max(worst, float((row - want[r][end - 1]).abs().max()))
    assert worst < 1e-4


def test_resuming_from_a_copied_state_slot_matches_transformers(checkpoint) -> None:
    """The prefix cache's use of the state region: snapshot a's slot after a page-aligned
    prefix, start b from the copy (sharing a's pages), and both continue exactly."""
    path, hf = checkpoint
    model, spec = load(path)
    shared = prompt(40, 5)
    a, b = shared + prompt(12, 6), shared + prompt(20, 7)
    harness = StateHarness(model, spec, page_size=4)
    harness.step([("a", shared[:17])])
    harness.step([("a", shared[17:])])
    harness.start_from("b", "a", 40)  # copy taken now: a's later steps must not leak into b
    got_a = harness.step([("a", a[40:])], all_rows=True)
    got_b = harness.step([("b", b[40:45]), ("a", [3])])[0]
    got_b2 = harness.step([("b", b[45:])], all_rows=True)
    assert float((got_a - hf_logits(hf, a)[40:]).abs().max()) < 1e-4
    want_b = hf_logits(hf, b)
    assert float((got_b - want_b[44]).abs().max()) < 1e-4
    assert float((got_b2 - want_b[45:]).abs().max()) < 1e-4


def test_greedy_generation_matches_transformers_generate(checkpoint) -> None:
    path, hf = checkpoint
    model, spec = load(path)
    ids = prompt(70, 8)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    want = out[0, len(ids) :].tolist()
    harness = StateHarness(model, spec)
    row = harness.step([("r", ids[:33])])
    row = harness.step([("r", ids[33:])])[0]
    got = []
    for _ in range(24):
        got.append(int(row.argmax()))
        row = harness.step([("r", [got[-1]])])[0]
    assert got == want


def test_bfloat16_keeps_the_ssm_state_in_float32_and_follows_transformers(checkpoint) -> None:
    path, hf = checkpoint
    model, spec = load_model(ModelConfig(path=str(path), dtype="bfloat16"), ParallelConfig())
    assert spec.state_shape is not None
    st = spec.state_shape
    assert (st.conv_dtype, st.ssm_dtype) == (torch.bfloat16, torch.float32)
    ids = prompt(60, 13)
    harness = StateHarness(model, spec)
    harness.step([("a", ids[:33])])
    got = harness.step([("a", ids[33:])], all_rows=True)
    want = hf_logits(hf, ids)[33:]  # float32 transformers: bf16 rounding is the only difference
    assert float((got - want).abs().max()) < 0.5
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_dummy_weights_run_at_the_checkpoints_shapes(checkpoint) -> None:
    config = ModelConfig(path=str(checkpoint[0]), load_format="dummy")
    model, spec = load_model(config, ParallelConfig())
    logits = StateHarness(model, spec).step([("a", prompt(20)), ("b", prompt(1))])
    assert logits.shape == (2, VOCAB) and bool(torch.isfinite(logits).all())
    assert spec.fingerprint == "dummy:0"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_deltanet_path_matches_the_torch_path(checkpoint) -> None:
    pytest.importorskip("triton")
    path, _ = checkpoint
    model, spec = load(path)
    ids = prompt(30, 9)
    want = StateHarness(model, spec).step([("a", ids[:20]), ("b", ids[:7])], all_rows=True)
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.fused = True  # only the DeltaNet kernels: the rest stays torch on CPU
    got = StateHarness(model, spec).step([("a", ids[:20]), ("b", ids[:7])], all_rows=True)
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_model_matches_transformers(checkpoint) -> None:
    """On CUDA the loader turns every fused kernel on: Triton paged attention, the DeltaNet's
    conv and delta rule, the fused norms and SiLU·mul. Chunks, a mixed step, decodes."""
    pytest.importorskip("triton")
    path, hf = checkpoint
    model, spec = load(path, device="cuda")
    assert model.model.layers[0].linear_attn.fused
    ids, other = prompt(90, 11), prompt(12, 12)
    want, want_other = hf_logits(hf, ids), hf_logits(hf, other)
    harness = StateHarness(model, spec, device="cuda")
    got = [harness.step([("a", ids[:70])])[0]]
    mixed = harness.step([("a", ids[70:80]), ("b", other)])
    # float32 on CUDA sums in another order than transformers on the CPU (below): up to
    # 1.4e-3 apart on the H200 for these rows
    assert float((mixed[1] - want_other[-1]).abs().max()) < 2e-3
    got += [mixed[0]]
    got += [harness.step([("a", [t]), ("b", [3])])[0] for t in ids[80:90]]
    rows = torch.stack(got)
    # float32 on CUDA sums in another order than transformers on the CPU: 1e-3-sized apart on
    # these logits, growing over the 20 steps after the prompt
    assert float((rows - want[[69, 79, *range(80, 90)]]).abs().max()) < 3e-3
    last = harness.step([("b", [4])])[0]
    assert float((last - hf_logits(hf, other + [3] * 10 + [4])[-1]).abs().max()) < 2e-3


def test_a_batch_without_state_slots_is_refused(checkpoint) -> None:
    model, spec = load(checkpoint[0])
    harness = StateHarness(model, spec)
    harness.step([("a", [5, 6])])
    with pytest.raises(ValueError, match="state_slots"):
        model.model.layers[0].linear_attn(torch.zeros(1, 64), _batch_without_slots(), harness.kv)


def _batch_without_slots():  # noqa: ANN202
    from worker.batch import ForwardBatch

    one = torch.tensor([0])
    return ForwardBatch(input_ids=one, positions=one, query_start=torch.tensor([0, 1]),
                        seq_lens=torch.tensor([1]), page_table=torch.tensor([[1]]),
                        slot_mapping=torch.tensor([4]), logits_indices=one,
                        query_start_list=[0, 1], seq_lens_list=[1])


@pytest.mark.parametrize(("edit", "match"), [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention",
                      "linear_attention"]}, "layer_types must list 4 entries"),
    ({"linear_num_value_heads": 3},
     r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be a positive integer"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     "partial_rotary_factor 0.3"),
])
def test_bad_config_fields_are_named(checkpoint, tmp_path: Path, edit: dict, match: str) -> None:
    src = checkpoint[0]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ModelLoadError, match=match):
        load(tmp_path)


# ---- tensor / expert parallelism over gloo ------------------------------------------------------
TP_EPS = (1, 2)
TP2_IDS = prompt(20, 10)


def _rank(rank: int, path: str, init_file: str, out_dir: str, ids: list[int]) -> None:
    """One of two ranks: its heads of every mixer, MoE by feature (ep 1), then by expert (ep 2),
    each over a fresh load and KV pool."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for ep in TP_EPS:
            model, spec = load(Path(path), tp_size=2, tp_rank=rank, ep_size=ep)
            assert spec.state_shape is not None
            assert spec.state_shape.ssm == (2, 16, 8)  # half the value heads
            harness = StateHarness(model, spec, tp_size=2)
            rows = [harness.step([("r", ids[:9]), ("s", ids[:4])]),
                    harness.step([("r", ids[9:-2]), ("s", ids[4:6])])]
            rows += [harness.step([("r", [t])]) for t in ids[-2:]]
            torch.save(torch.cat(rows), f"{out_dir}/logits{rank}-ep{ep}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_run(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Both EP layouts on one pair of spawned ranks (a spawn costs two interpreters importing
    torch and transformers): (their output directory, the spawn's error or ''). A layout that
    failed leaves no logits; its test fails with the error."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("qwen3next-tp2")
    try:
        mp.spawn(_rank, args=(str(checkpoint[0]), str(out / "init"), str(out), TP2_IDS), nprocs=2)
    except Exception as exc:  # reported by each layout's test, not as a fixture error
        return out, f"{type(exc).__name__}: {exc}"
    return out, ""


@pytest.mark.slow
@pytest.mark.parametrize("ep", TP_EPS)
def test_tp2_matches_transformers_on_every_rank(checkpoint, tp2_run, ep: int) -> None:
    _, hf = checkpoint
    out, error = tp2_run
    ids = TP2_IDS
    full, short = hf_logits(hf, ids), hf_logits(hf, ids[:6])
    want = torch.stack([full[8], short[3], full[17], short[5], full[18], full[19]])
    for rank in (0, 1):
        logits = out / f"logits{rank}-ep{ep}.pt"
        assert logits.is_file(), f"rank {rank} wrote no logits for ep={ep}: {error}"
        got = torch.load(logits)
        assert float((got - want).abs().max()) < 1e-4
    if ep == TP_EPS[-1]:  # an error after the last layout's logits (the group's teardown)
        assert not error, error
