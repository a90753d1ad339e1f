"""GPT-OSS (GptOssForCausalLM) on CPU against transformers, and its parallel layouts for real.

- config: layer types, MoE, SwiGLU knobs and YaRN read from config.json; an MXFP4
  `quantization_config` refused in one line naming it;
- model: chunked prefill + decode logits equal transformers' (sinks through TorchSDPABackend's
  masked full pages), and the sinks, the router bias and the clamp each change them;
- engine (window layers in rings, sinks through window_attention): greedy = transformers for
  prompts shorter and longer than the window and the chunk, prefix hits (the same prompt twice,
  prompts sharing a long prefix) with bounded replay, preemption and abort, all drained;
- EP=2, MoE TP=2 with attention TP=2, and attention DP=2 with EP=2 over gloo (two processes)
  give the one-rank logits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.worker.gpt_oss_model import WINDOW, build_gpt_oss_checkpoint
from tests.worker.test_engine import generate, hf_greedy, make_engine
from worker.arch.gpt_oss_config import GptOssArch
from worker.arch.load import load_arch_config
from worker.config import ModelConfig, ParallelConfig
from worker.engine import Engine, RequestOutput
from worker.model import ModelLoadError, load_model
from worker.model.gpt_oss import GptOssMoE
from worker.request import Request
from worker.sampling import SamplingParams

VOCAB = 128
SEQS = {
    "a": [random.Random(1).randrange(VOCAB) for _ in range(26)],
    "b": [random.Random(2).randrange(VOCAB) for _ in range(19)],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return path, build_gpt_oss_checkpoint(path)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]


def _run(
    model, spec, seqs: dict[str, list[int]], tp_size: int = 1
) -> dict[str, list[tuple[int, torch.Tensor]]]:  # noqa: ANN001
    """Prefill every sequence in two chunks together, then decode 4 tokens each (teacher-forced)."""
    from tests.worker.conftest import PagedHarness

    harness = PagedHarness(model, spec, page_size=4, tp_size=tp_size)
    out: dict[str, list[tuple[int, torch.Tensor]]] = {r: [] for r in seqs}
    for lo, hi in [(0, 9), (9, -4), (-4, -3), (-3, -2), (-2, -1), (-1, None)]:
        chunks = [(r, s[lo:hi] if hi is not None else s[lo:]) for r, s in seqs.items()]
        logits = harness.step(chunks)
        for (r, _), row in zip(chunks, logits, strict=True):
            out[r].append((harness.num_tokens[r] - 1, row))
    return out


def _reference(hf: torch.nn.Module, seqs: dict[str, list[int]] = SEQS) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {r: hf(torch.tensor([s])).logits[0] for r, s in seqs.items()}  # [L, V]


def _worst(got: dict[str, list[tuple[int, torch.Tensor]]], ref: dict[str, torch.Tensor]) -> float:
    return max(
        float((row - ref[r][pos]).abs().max()) for r, rows in got.items() for pos, row in rows
    )


# ---- config ----------------------------------------------------------------------------------
def test_config_reads_the_family(ckpt: tuple[Path, torch.nn.Module]) -> None:
    arch = load_arch_config(ckpt[0])
    assert arch.layer_windows == (WINDOW, None, WINDOW, None)
    assert arch.qkv_bias and arch.o_bias and not arch.qk_norm
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (4, 2)
    assert arch.moe.intermediate_size == 32 and all(arch.moe.sparse_layers)
    assert arch.family == GptOssArch(swiglu_alpha=1.702, swiglu_limit=1.5)
    assert arch.rope.rope_type == "yarn" and arch.rope.factor == 4.0 and not arch.rope.truncate


def test_mxfp4_checkpoint_is_refused_in_one_line(
    ckpt: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    raw = json.loads((ckpt[0] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelLoadError, match="quantization_config .*'mxfp4'.* not supported"
    ) as err:
        load_arch_config(tmp_path)
    assert "\n" not in str(err.value)


def test_tandem_worker_refuses_mxfp4_in_one_line(
    ckpt: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main
    from orchestrator.launch.background import free_ports

    raw = json.loads((ckpt[0] / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    argv = [
        "worker",
        "--config",
        "configs/tiny-mono.yaml",
        "--role",
        "both",
        "--set",
        f"model.path={tmp_path}",
        "--set",
        f"roles.both.base_port={free_ports(1)[0]}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "quantization_config" in err and "\n" not in err


# ---- model -----------------------------------------------------------------------------------
def test_logits_equal_transformers(ckpt: tuple[Path, torch.nn.Module]) -> None:
    path, hf = ckpt
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    assert spec.architecture == "GptOssForCausalLM" and not model.supports_cuda_graphs
    assert all(isinstance(layer.mlp, GptOssMoE) for layer in model.model.layers)
    ref = _reference(hf)
    assert _worst(_run(model, spec, SEQS), ref) < 1e-4


@pytest.mark.parametrize("change", ["sinks", "router_bias", "clamp"])
def test_each_gpt_oss_piece_changes_the_logits(
    ckpt: tuple[Path, torch.nn.Module], change: str
) -> None:
    """A guard on the fixture: were a piece ignored, the equality above would still have to fail."""
    path, hf = ckpt
    model, spec = load_model(ModelConfig(path=str(path)), ParallelConfig())
    with torch.no_grad():
        for layer in model.model.layers:
            if change == "sinks":
                layer.self_attn.sinks.fill_(-1e4)  # a sink that never wins: plain softmax
            elif change == "router_bias":
                layer.mlp.gate_bias.zero_()
            else:
                layer.mlp.limit = 1e4
    assert _worst(_run(model, spec, SEQS), _reference(hf)) > 1e-2


# ---- engine ----------------------------------------------------------------------------------
def test_engine_keeps_window_layers_in_rings(ckpt: tuple[Path, torch.nn.Module]) -> None:
    engine = make_engine(ckpt[0], chunk=16)
    shape = engine.kv.shape
    assert (
        shape.window_layers == (0, 2)
        and shape.window == WINDOW
        and shape.ring_pages == WINDOW // 4 + 1
    )


def test_engine_greedy_equals_transformers(ckpt: tuple[Path, torch.nn.Module]) -> None:
    path, hf = ckpt
    engine = make_engine(path, chunk=16)
    prompts = _prompts(
        0, (5, WINDOW, 17, 40, 61)
    )  # shorter and longer than the window and the chunk
    ours = generate(engine, prompts, max_tokens=12)  # one batch: chunks and decodes mixed
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 12), f"prompt of {len(prompt)} tokens"
    engine.scheduler.assert_drained()


def _window_pages_held(engine: Engine) -> int:
    """Window-ring pages held by live requests."""
    return engine.scheduler.stats().window_used_pages


def _run_one(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    out: list[int] = []
    cached: list[int] = []
    done: list[bool] = []

    def sink(o: RequestOutput) -> None:
        assert o.finish_reason != "error", o.error
        out.extend(o.token_ids)
        if o.num_prompt_tokens:
            cached.append(o.num_cached_tokens)
        done.extend([True] if o.finished else [])

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.submit(Request(f"r{random.random()}", prompt, params), sink)
    while not done:
        engine.step()
    return out, cached[0]


def test_prefix_hits_replay_a_bounded_suffix(ckpt: tuple[Path, torch.nn.Module]) -> None:
    path, hf = ckpt
    engine = make_engine(path, chunk=16)
    sched = engine.scheduler
    shared = _prompts(1, (48,))[0]
    first, cached = _run_one(engine, shared, 6)
    assert cached == 0 and first == hf_greedy(hf, shared, 6)
    again, cached = _run_one(engine, shared, 6)  # the same prompt twice: the hit stops a page short
    assert again == first and cached == (44 - 2 * (WINDOW - 1)) // 4 * 4
    before = sched.prompt_tokens_computed
    prompt = shared + [9, 10, 11, 12, 13]  # shares 12 full pages
    got, cached = _run_one(engine, prompt, 10)
    assert got == hf_greedy(hf, prompt, 10)  # the rings were rebuilt exactly
    replay_from = (48 - 2 * (WINDOW - 1)) // 4 * 4
    assert cached == replay_from
    assert sched.prompt_tokens_computed - before == len(prompt) - replay_from
    sched.assert_drained()


def test_preemption_and_abort_free_pages_and_rings(ckpt: tuple[Path, torch.nn.Module]) -> None:
    path, hf = ckpt
    engine = make_engine(
        path, chunk=16, num_pages=30, max_num_seqs=4
    )  # few pages: the batch preempts
    prompts = _prompts(3, (30, 31, 29, 33))
    ours = generate(engine, prompts, max_tokens=16)
    assert engine.scheduler.num_preemptions > 0
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 16)
    engine.scheduler.assert_drained()
    finished: list[str] = []

    def sink(o: RequestOutput) -> None:
        if o.finished:
            finished.append(o.finish_reason)

    engine.submit(Request("gone", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True)), sink)
    engine.step()
    engine.step()
    assert _window_pages_held(engine) > 0  # running: holds its rings
    engine.abort("gone")
    engine.step()
    assert finished == ["abort"]
    engine.scheduler.assert_drained()


# ---- parallel layouts (gloo, two processes) ----------------------------------------------------
def _rank_main(rank: int, path: str, init_file: str, out_dir: str) -> None:
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
            assert isinstance(block, GptOssMoE)
            if name == "ep2":
                assert (
                    list(block.expert_ids()) == [2 * rank, 2 * rank + 1] and block.w13.shape[0] == 2
                )
            else:
                assert block.w13.shape == (4, 2 * 16, 64) and block.owns_down_bias == (rank == 0)
            assert model.model.layers[0].self_attn.sinks.shape == (2,)  # this rank's 2 of 4 heads
            torch.save(_run(model, spec, SEQS, tp_size=2), f"{out_dir}/{name}-{rank}.pt")
        # Attention DP (tp 1, dp 2): each rank its own sequence; the experts are shared (EP=2).
        model, spec = load_model(cfg, ParallelConfig(tp_size=1, tp_rank=0, dp_size=2, ep_size=2))
        mine = {
            "ab"[rank]: SEQS["ab"[rank]][:19]
        }  # same step count on both ranks: the all-to-alls pair up
        torch.save(_run(model, spec, mine), f"{out_dir}/dp2-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ep2_moe_tp2_and_dp_attention_equal_transformers(
    ckpt: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    path, hf = ckpt
    ref = _reference(hf)
    mp.spawn(_rank_main, args=(str(path), str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for name in ("ep2", "moe_tp2"):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            assert _worst(got, ref) < 1e-4, f"{name} rank {rank}"
    for rank in (0, 1):
        seq = {"ab"[rank]: SEQS["ab"[rank]][:19]}
        assert _worst(torch.load(tmp_path / f"dp2-{rank}.pt"), _reference(hf, seq)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_engine_tp2_equals_transformers_when_the_window_never_slides(
    tmp_path: Path, ep: int
) -> None:
    """A TP=2 engine (rank 1 a spawned process) with MoE TP (ep 1) or EP=2: greedy tokens equal
    transformers'. Multi-rank workers refuse window rings, so the window here reaches the whole
    context (max_model_len = window; its yarn rope would serve 4x): the sliding layers stay in
    masked full pages."""
    from worker.config import CacheConfig, SchedulerConfig, WorkerConfig

    hf = build_gpt_oss_checkpoint(tmp_path, sliding_window=64, max_position_embeddings=64)
    engine = Engine(
        WorkerConfig(
            model=ModelConfig(path=str(tmp_path), dtype="float32", max_model_len=64),
            cache=CacheConfig(page_size=4, num_pages=128),
            scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=16),
            parallel=ParallelConfig(tp_size=2, ep_size=ep),
            num_threads=1,
        )
    )
    try:
        assert engine.kv.shape.window_layers == ()
        prompts = _prompts(7, (23, 9, 40))
        got = generate(engine, prompts, max_tokens=8)
        for prompt, tokens in zip(prompts, got, strict=True):
            assert tokens == hf_greedy(hf, prompt, 8)
        engine.scheduler.assert_drained()
    finally:
        engine.close()
