"""Model drafters (speculative.method draft | eagle | mtp): heads over the target's pages.

- The engine's EAGLE head computes what its training module (models/train_eagle.py, in
  transformers' layers) computes, position by position, over paged KV.
- Greedy output with each method equals the output without speculation, token for token, in
  one engine (mono), with max_tokens ending requests mid-draft, eos inside accepted drafts and
  aborts; every page comes back. The shipped drafters of the embedded model (eagle, draft, and
  mtp: an MTP module trained beside it) really draft (accepted > 0); DeepSeek-V3's and
  Qwen3-Next's MTP layers (random weights) run their steps.
- A prefix hit with an eagle head gives back its last page (recomputed): the output holds.
- Drafters that cannot share the target's pages, and methods a model cannot run, are refused
  in one line naming the field.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from orchestrator.launch.background import EMBEDDED_MODEL
from tests.worker.conftest import build_tiny_checkpoint
from tests.worker.test_spec import _generate
from transfer.contract import KVLayout, LayoutContract
from worker.batch import ForwardBatch
from worker.cache_layout import kv_shape
from worker.config import ConfigError, ModelConfig, SpeculativeConfig, WorkerConfig
from worker.engine import Engine
from worker.kv_cache import KVCache
from worker.model import load_model
from worker.request import Request
from worker.sampling import SamplingParams
from worker.spec.load import load_head

EAGLE = Path(EMBEDDED_MODEL) / "eagle"
DRAFT = Path(EMBEDDED_MODEL) / "draft"


def _config(method: str, path: str | Path = EMBEDDED_MODEL, k: int = 4, model: str = "",
            **kw: object) -> WorkerConfig:
    spec = SpeculativeConfig(method=method,  # type: ignore[arg-type]
                             num_speculative_tokens=k, model=model)
    return WorkerConfig(model=ModelConfig(path=str(path)), speculative=spec, num_threads=1,
                        **kw)  # type: ignore[arg-type]


def _dense_batch(tokens: list[int], pages: list[int], page_size: int) -> ForwardBatch:
    """One request's first chunk: every token at positions 0.. over the given pages."""
    n = len(tokens)
    slots = [pages[p // page_size] * page_size + p % page_size for p in range(n)]
    return ForwardBatch(
        input_ids=torch.tensor(tokens), positions=torch.arange(n),
        query_start=torch.tensor([0, n]), seq_lens=torch.tensor([n]),
        page_table=torch.tensor([pages]), slot_mapping=torch.tensor(slots),
        logits_indices=torch.tensor([n - 1]), query_start_list=[0, n], seq_lens_list=[n])


@pytest.mark.parametrize("layout", ["eagle", "mtp"])
def test_a_head_computes_what_its_training_module_computes(layout: str, tmp_path: Path) -> None:
    """eagle, and the MTP module in DeepSeek's layout for a dense target (method mtp)."""
    from transformers import AutoModelForCausalLM

    from models.train_eagle import random_head, ttt_mask

    ref = random_head(Path(EMBEDDED_MODEL), tmp_path / layout, seed=3, layout=layout).eval()
    config = _config(layout, model=str(tmp_path / layout))
    target, spec = load_model(config.model, config.parallel)
    loaded = load_head(config, target, spec)
    assert loaded is not None and loaded.label.startswith(f"{layout}:1:")
    kv = KVCache(kv_shape(spec, config, loaded.head.num_layers, loaded.label))
    assert kv.shape.num_layers == spec.num_layers + 1
    rng = random.Random(0)
    tokens = [rng.randrange(6, 100) for _ in range(37)]
    pages = [9, 3, 14]  # out of order: the head writes where the target's pages are
    with torch.inference_mode():
        hidden = target(_dense_batch(tokens, pages, 16), kv)  # [37, H]
        # The head at p reads x_{p+1} and h_p: positions 0..35.
        feats = loaded.head(_dense_batch(tokens[1:], pages, 16), kv, hidden[:-1])
        logits = loaded.head.compute_logits(feats)
    with torch.no_grad():  # the training module's parameters are not inference tensors
        hf = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
        ids = torch.tensor([tokens])
        h_ref = hf.model(input_ids=ids).last_hidden_state  # [1, 37, H]
        n = len(tokens) - 1
        want = ref(hf.model.embed_tokens(ids[:, 1:]), h_ref[:, :-1], torch.arange(n)[None],
                   ttt_mask(n, 1))[0]
        want_logits = hf.lm_head(ref.logits_input(want))
    assert torch.allclose(hidden, h_ref[0], atol=1e-4)
    assert torch.allclose(feats, want, atol=1e-4), (feats - want).abs().max()
    assert torch.allclose(logits, want_logits, atol=1e-3)


def _lengths(i: int) -> SamplingParams:
    # max_tokens varies so requests end mid-draft; the answers end on eos inside drafts.
    return SamplingParams(temperature=0.0, max_tokens=5 + 2 * i)


@pytest.mark.parametrize("method", ["eagle", "draft", "mtp"])
def test_shipped_heads_equal_plain_greedy_token_for_token(
        method: str, arith_prompts: list[list[int]]) -> None:
    plain = _generate(Engine(_config("none")), arith_prompts, _lengths)
    engine = Engine(_config(method))
    got = _generate(engine, arith_prompts, _lengths, abort={7})  # aborted at its third step
    assert got[7][1] == "abort"
    assert got[:7] == plain[:7]
    counters = engine.spec_counters
    assert 0 < counters.accepted <= counters.drafted
    engine.scheduler.assert_drained()


@pytest.fixture(scope="module")
def arith_prompts() -> list[list[int]]:
    from gateway.tokenizer import Tokenizer
    from orchestrator.tasks import arith

    tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
    return [tok.encode(p.prompt) for p in arith.make_problems(8, seed=11)]


def test_deepseek_mtp_layer_drafts_and_greedy_holds(tmp_path: Path) -> None:
    from tests.worker.deepseek_model import build_deepseek_checkpoint

    build_deepseek_checkpoint(tmp_path, mtp=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (9, 23, 40)]

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)

    plain = _generate(Engine(_config("none", tmp_path)), prompts, params)
    engine = Engine(_config("mtp", tmp_path, k=3))
    assert engine.kv.shape.latent_dim and engine.kv.shape.draft_layers == 1
    assert _generate(engine, prompts, params) == plain
    assert engine.spec_counters.drafted > 0
    engine.scheduler.assert_drained()


def test_prefix_hit_with_eagle_recomputes_the_last_page_and_holds(
        arith_prompts: list[list[int]]) -> None:
    engine = Engine(_config("eagle", k=3))
    prompt = arith_prompts[0]
    outs: list[tuple[list[int], int]] = []
    for i in range(2):  # one after the other: the second hits the first's cached pages
        got: list[int] = []
        cached: list[int] = []

        def sink(o: object, got: list[int] = got, cached: list[int] = cached) -> None:
            got.extend(o.token_ids)  # type: ignore[attr-defined]
            if o.num_cached_tokens:  # type: ignore[attr-defined]
                cached.append(o.num_cached_tokens)  # type: ignore[attr-defined]

        engine.submit(Request(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12)),
                      sink)
        while engine.step() or engine.has_pending_work():
            pass
        outs.append((got, cached[0] if cached else 0))
    page = engine.kv.shape.page_size
    assert outs[0][1] == 0
    assert outs[1][1] == ((len(prompt) - 1) // page - 1) * page  # all full pages but the last
    assert outs[1][0] == outs[0][0]
    engine.scheduler.assert_drained()


def test_seeded_sampling_with_eagle_reproduces_and_leaves_nothing(
        arith_prompts: list[list[int]]) -> None:
    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=14)

    runs = []
    for _ in range(2):
        engine = Engine(_config("eagle", k=3))
        runs.append(_generate(engine, arith_prompts[:4], params))
        assert engine.spec_counters.drafted > 0  # drafts drawn from the head's distribution
        engine.scheduler.assert_drained()
    assert runs[0] == runs[1]


def test_draft_model_with_another_kv_geometry_is_refused(tmp_path: Path) -> None:
    build_tiny_checkpoint(tmp_path / "d", "qwen3", vocab_size=128, num_key_value_heads=4,
                          head_dim=16, max_position_embeddings=512)
    with pytest.raises(ConfigError, match=r"speculative.model.*num_key_value_heads 4 != "
                                          r"the target's 2, head_dim 16 != the target's 32"):
        Engine(_config("draft", model=str(tmp_path / "d")))


def test_draft_tokenizer_must_keep_the_targets_token_ids(tmp_path: Path) -> None:
    import json
    import shutil

    # The shipped draft predates the target's 8 added tokens (ids 103-110): accepted.
    target_tok = json.loads((Path(EMBEDDED_MODEL) / "tokenizer.json").read_text())
    draft_tok = json.loads((DRAFT / "tokenizer.json").read_text())
    assert len(target_tok["added_tokens"]) == len(draft_tok["added_tokens"]) + 8
    config = _config("draft")
    target, spec = load_model(config.model, config.parallel)
    assert load_head(config, target, spec) is not None
    # A draft whose ids mean other text than the target's is refused, naming the first id.
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT, bad, ignore=shutil.ignore_patterns("model.safetensors"))
    (bad / "model.safetensors").symlink_to(DRAFT / "model.safetensors")
    vocab = draft_tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (bad / "tokenizer.json").write_text(json.dumps(draft_tok))
    with pytest.raises(ConfigError, match=r"speculative.model: .* maps 2 token ids differently "
                                          r"from the target's .*\(id \d+: 'b' vs 'a'\)"):
        load_head(_config("draft", model=str(bad)), target, spec)


def test_methods_a_model_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="speculative.model: .* has no config.json and .* "
                                          "declares no MTP layer of its own"):
        Engine(_config("mtp", model=str(tmp_path)))
    with pytest.raises(ConfigError, match="speculative.model.*has no config.json"):
        Engine(_config("eagle", model=str(tmp_path)))
    with pytest.raises(ConfigError, match="speculative.model is the checkpoint of a model drafter"):
        SpeculativeConfig(method="ngram", model="x").validate()


def test_a_drafter_enters_the_layout_contract() -> None:
    base = KVLayout(num_pages=8, num_layers=5, page_size=16, head_dim=32, dtype="float32",
                    num_kv_heads_total=2)
    plain = KVLayout(num_pages=8, num_layers=4, page_size=16, head_dim=32, dtype="float32",
                     num_kv_heads_total=2)

    def contract(layout: KVLayout, label: str = "") -> LayoutContract:
        from dataclasses import replace

        return LayoutContract.from_layout(replace(layout, speculative=label), model_name="m",
                                          model_fingerprint="f", backend="mooncake")

    eagle = contract(base, "eagle:1:abc")
    assert any(d.startswith("speculative: 'eagle:1:abc' != ''") for d in
               eagle.mismatches(contract(plain)))
    assert any(d.startswith("speculative:") for d in eagle.mismatches(contract(base,
                                                                               "draft:1:abc")))
    assert contract(plain).hash() == LayoutContract.from_layout(
        plain, model_name="m", model_fingerprint="f", backend="mooncake").hash()
    assert not eagle.mismatches(contract(base, "eagle:1:abc"))


def _qwen3_next_with_mtp(path: Path) -> dict[str, torch.Tensor]:
    """The tiny Qwen3-Next checkpoint plus random `mtp.*` tensors (transformers writes none):
    an MTP layer shaped like its full-attention layer 2, fc, and the three norms."""
    import json

    from safetensors.torch import load_file, save_file

    from tests.worker.qwen3_next_model import CONFIG as QN
    from tests.worker.qwen3_next_model import build_qwen3_next_checkpoint

    build_qwen3_next_checkpoint(path)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    h = QN["hidden_size"]
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.2."):
            tensors["mtp.layers.0." + name[len("model.layers.2."):]] = torch.randn(
                t.shape, generator=gen) * 0.1
    for name, shape in (("fc.weight", (h, 2 * h)), ("norm.weight", (h,)),
                        ("pre_fc_norm_embedding.weight", (h,)),
                        ("pre_fc_norm_hidden.weight", (h,))):
        tensors[f"mtp.{name}"] = torch.randn(shape, generator=gen) * 0.1
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return tensors


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_recurrent_state_follows_only_the_accepted_drafts(method: str, tmp_path: Path) -> None:
    """Qwen3-Next (Gated DeltaNet state slots): a verify leaves each request's state after its
    last accepted token, so greedy output holds with drafts rejected along the way."""
    _qwen3_next_with_mtp(tmp_path)
    rng = random.Random(7)
    base = [rng.randrange(3, 128) for _ in range(6)]
    prompts = [base * 4, [rng.randrange(3, 128) for _ in range(19)], base * 2 + [9, 9]]

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=10 + 4 * i, ignore_eos=True)

    plain = _generate(Engine(_config("none", tmp_path)), prompts, params)
    engine = Engine(_config(method, tmp_path, k=3))
    assert _generate(engine, prompts, params) == plain
    c = engine.spec_counters
    assert c.drafted > c.accepted  # some drafts were rejected: their state must not stay
    engine.scheduler.assert_drained()


def test_qwen3_next_mtp_layer_loads_and_runs_over_its_page_layer(tmp_path: Path) -> None:
    """The `mtp.*` tensors load into Qwen3NextForCausalLM.mtp (built like a full-attention MoE
    layer, its KV in the layer after the model's); the head runs a paged chunk."""
    from tests.worker.qwen3_next_model import CONFIG as QN
    from worker.spec.heads import Qwen3NextMTPHead

    tensors = _qwen3_next_with_mtp(tmp_path)
    h = QN["hidden_size"]
    model, spec = load_model(ModelConfig(path=str(tmp_path)), _config("none").parallel)
    assert model.mtp is not None  # type: ignore[attr-defined]
    assert torch.equal(model.mtp.fc.weight, tensors["mtp.fc.weight"])  # type: ignore[attr-defined]
    head = Qwen3NextMTPHead(model)  # type: ignore[arg-type]
    shape = kv_shape(spec, _config("none", tmp_path), head.num_layers, "mtp:1")
    kv = KVCache(shape)
    assert shape.num_full_layers == 2  # the model's one attention layer, then the MTP layer's
    tokens = [5, 9, 17, 33, 2, 8]
    batch = _dense_batch(tokens, [1], 16)
    with torch.inference_mode():
        feats = head(batch, kv, torch.randn(len(tokens), h))
        assert head.compute_logits(feats).shape == (len(tokens), QN["vocab_size"])
    assert kv.layer(spec.num_layers)[0][1].abs().sum() > 0  # its K landed in page 1


def _verify_plan(engine: Engine, prompts: list[list[int]], drafts: list[list[int]]) -> object:
    """Prompts run to their first token, then one verify plan with the given drafts."""
    for i, p in enumerate(prompts):
        engine.scheduler.add(Request(f"v{i}", p, SamplingParams(temperature=0.0, max_tokens=9)))
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        plan = engine.scheduler.schedule()
        engine.scheduler.update(plan, engine.runner.run(plan))
    plan = engine.scheduler.schedule()
    for chunk, ds in zip(plan.chunks, drafts, strict=True):
        chunk.drafts = list(ds)
        chunk.num_tokens += len(ds)
        plan.num_tokens += len(ds)
    return plan


def test_verify_graph_padding_gives_the_plain_verify_rows(arith_prompts: list[list[int]]) -> None:
    """The padded batch a verify graph replays (requests with 3, 1 and 0 drafts at k = 3)
    scores the real rows as the plain verify step does, and writes only their KV."""
    from worker.verify_graphs import VerifyGraphs

    engine = Engine(_config("none"))
    engine.scheduler.num_speculative_tokens = 3
    plan = _verify_plan(engine, arith_prompts[:3], [[61, 62, 63], [64], []])
    with torch.inference_mode():
        hidden, logits = engine.runner.forward_hidden(plan)  # type: ignore[arg-type]
        before = engine.kv.data.clone()
        graphs = VerifyGraphs(engine.model, engine.kv, 8, engine.max_model_len, 3)
        assert graphs.fits(plan.chunks) is False  # nothing captured on the CPU
        g_hidden, g_logits = graphs.eager(plan.chunks)  # type: ignore[attr-defined]
    assert logits is not None and g_logits.shape == logits.shape == (4 + 2 + 1, 128)
    assert torch.allclose(g_hidden, hidden, atol=1e-5)
    assert torch.allclose(g_logits, logits, atol=1e-4)
    assert torch.allclose(engine.kv.data, before, atol=1e-4)  # padding rows stored nothing
    for req in list(engine.scheduler.running):
        engine.scheduler.abort(req.request_id)
    engine.scheduler.assert_drained()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["one-rank", "tp2"])
def test_decode_graph_steps_beside_eagle_drafts_hold(
        tp: int, arith_prompts: list[list[int]]) -> None:
    """Requests that do not speculate (logprobs) beside ones that do: their pure-decode steps
    run through the decode graphs (on a CPU: eager steps over the static buffers, and with
    TP=2 the GRAPH_STEP protocol for real), and the eagle head catches up on every step's
    hidden states (with TP=2: DRAFT messages after GRAPH_STEPs, on every rank). Output and
    acceptance equal an eager engine's running the same head; pages all come back."""
    from worker.config import ParallelConfig

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=10, logprobs=i < 3)

    def run(graphs: bool, method: str = "eagle") -> tuple[list[tuple[list[int], str]], int]:
        engine = Engine(_config(method, parallel=ParallelConfig(tp_size=tp)))
        try:
            if graphs:  # decode graphs only (piecewise graphs capture only on CUDA)
                engine.runner.enable_cuda_graphs(6, engine.max_model_len, 4)
            # the logprobs requests alone first: whole steps of pure decode
            out = _generate(engine, arith_prompts[:3], params)
            out += _generate(engine, arith_prompts[3:6], lambda i: params(i + 3))
            if graphs:
                assert engine.runner.decode_graphs is not None
                assert engine.runner.decode_graphs.num_replays >= 9
            engine.scheduler.assert_drained()
            return out, engine.spec_counters.accepted
        finally:
            engine.close()

    plain, _ = run(False, "none")
    eager, eager_accepted = run(False)
    graphed, graphed_accepted = run(True)
    assert eager == plain and graphed == plain
    assert graphed_accepted == eager_accepted > 0


@pytest.mark.parametrize("method", ["eagle", "draft"])
def test_draft_steps_over_the_graph_buffers_hold(
        method: str, arith_prompts: list[list[int]]) -> None:
    """A model drafter's draft steps and catch-ups through the graphs' static buffers (on a
    CPU: run eagerly over them; worker/spec/draft_graphs.py), batches padded to their bucket,
    catch-up rows to k + 1: the output equals speculation off's, acceptance equals the eager
    drafter's, and every page comes back."""
    plain = _generate(Engine(_config("none")), arith_prompts[:5], _lengths)
    eager = Engine(_config(method))
    assert _generate(eager, arith_prompts[:5], _lengths) == plain
    engine = Engine(_config(method))
    drafter = engine.runner.drafter
    assert drafter is not None
    assert drafter.enable_cuda_graphs(6, engine.max_model_len, 4, engine.spec.hidden_size)
    assert _generate(engine, arith_prompts[:5], _lengths) == plain
    assert drafter.graphs is not None and drafter.graphs.num_replays > 0
    assert drafter.catch_up_graphs is not None and drafter.catch_up_graphs.num_replays > 0
    assert engine.spec_counters.accepted == eager.spec_counters.accepted > 0
    engine.scheduler.assert_drained()


def test_a_decode_graph_step_returns_the_eager_hidden_states(
        arith_prompts: list[list[int]]) -> None:
    """What a model drafter catches up on after a pure-decode step replayed as a graph (on a
    CPU: the same static buffers, run eagerly) is the eager step's final hidden states."""
    engine = Engine(_config("none"))
    plan = _verify_plan(engine, arith_prompts[:3], [[], [], []])  # no drafts: pure decode
    with torch.inference_mode():
        hidden, logits = engine.runner.forward_hidden(plan)  # type: ignore[arg-type]
        engine.runner.enable_cuda_graphs(8, engine.max_model_len)
        g_hidden, g_logits = engine.runner.forward_hidden(plan)  # type: ignore[arg-type]
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays == 1
    assert logits is not None and g_logits is not None and g_hidden.shape == hidden.shape
    assert torch.allclose(g_hidden, hidden, atol=1e-5)
    assert torch.allclose(g_logits, logits, atol=1e-4)
    for req in list(engine.scheduler.running):
        engine.scheduler.abort(req.request_id)
    engine.scheduler.assert_drained()
