"""Model drafters under PD: the drafter's KV rides in the pages, eagle's last feature on DONE.

- 1P1D with eagle, mtp (the embedded model's side-trained MTP module) and the draft model:
  greedy output equals a cluster without speculation, token for token, on arith prompts and
  the chat formats (thinking, tool calls; the draft model never saw their added tokens), also
  when prefill's prefix cache hits; decode drafts (and accepts) yet never runs a prompt token
  through the target, and prefill never drafts.
- Heterogeneous TP with eagle (prefill TP=2 → decode TP=1, and TP=1 → TP=2): each rank's
  share of the head's KV pages lands where the decode ranks read it; the output equals mono's,
  and decode's acceptance is that of a mono worker running the same head (a lost feature or a
  garbled head page would cost the first drafts of every request).
- A prefill worker without the drafter and a decode worker with it are refused at bootstrap,
  naming `speculative`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster
from orchestrator.tasks import arith
from protocol import tandem_pb2
from tests.e2e.test_hetero_tp import _wait_drained, pd_generate, served
from tests.e2e.test_pd import complete_all
from tests.e2e.test_spec_pd import agent_prompts
from transfer.config import TransferConfig
from worker.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)

pytestmark = pytest.mark.slow
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in arith.make_problems(16, seed=29)] + agent_prompts(6, seed=29)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, prompts: list[str]) -> list[str]:
    with running_cluster("configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("plain")) as c:
        return asyncio.run(complete_all(c.url, prompts, MAX_TOKENS))


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft"])
def test_model_drafter_1p1d_equals_plain_greedy(method: str, prompts: list[str],
                                                plain: list[str], tmp_path: Path) -> None:
    with running_cluster("configs/tiny-1p1d.yaml", f"speculative.method={method}",
                         "speculative.num_speculative_tokens=3", tmp=tmp_path) as c:
        got = asyncio.run(complete_all(c.url, prompts, MAX_TOKENS))
        # Again: prefill's prefix cache hits now (eagle: all but the hit's last page, which it
        # recomputes with the head), and what it ships still decodes to the same answers.
        again = asyncio.run(complete_all(c.url, prompts, MAX_TOKENS))
        loads = c.wait_drained()
    assert got == plain and again == plain
    decode, prefill = loads["decode-0"], loads["prefill-0"]
    assert decode.spec.accepted_tokens > 0
    assert decode.prompt_tokens_computed == 0  # decode never runs the prompt
    assert not prefill.HasField("spec")  # prefill computed the head's KV, drafted nothing


def _worker(role: str, tp: int, method: str = "eagle") -> WorkerConfig:
    from tests.e2e.test_hetero_tp import _free_port

    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        port=_free_port(),
        model=ModelConfig(path=str(EMBEDDED_MODEL)),
        cache=CacheConfig(page_size=16, num_pages=96, enable_prefix_cache=role != "decode"),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=256),
        parallel=ParallelConfig(tp_size=tp),
        transfer=TransferConfig(backend="mooncake", protocol="tcp",  # type: ignore[arg-type]
                                checksum=True),
        speculative=SpeculativeConfig(method=method,  # type: ignore[arg-type]
                                      num_speculative_tokens=3),
        num_threads=1,
    )


def _token_prompts() -> list[list[int]]:
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
    return [tok.encode(p.prompt) for p in arith.make_problems(4, seed=31)]


def _sampling() -> tandem_pb2.SamplingParams:
    return tandem_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _mono(config: WorkerConfig,
          prompts: list[list[int]]) -> tuple[list[list[int]], tandem_pb2.Load]:
    with served(config) as mono:
        outs = []
        for p in prompts:
            req = tandem_pb2.GenerateRequest(request_id="mono", prompt_token_ids=p,
                                             sampling=_sampling())
            outs.append([t for m in mono.Generate(req, timeout=60) for t in m.token_ids])
        return outs, _wait_drained(mono)


@pytest.fixture(scope="module")
def mono_runs() -> tuple[list[list[int]], list[list[int]], tandem_pb2.Load]:
    """Prompts, mono's plain output, and a mono eagle worker's load (its acceptance)."""
    prompts = _token_prompts()
    plain, _ = _mono(_worker("both", 1, "none"), prompts)
    eagle, load = _mono(_worker("both", 1), prompts)
    assert eagle == plain
    return prompts, plain, load


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)],
                         ids=["p-tp2-d-tp1", "p-tp1-d-tp2"])
def test_hetero_tp_with_eagle_equals_mono(
        prefill_tp: int, decode_tp: int,
        mono_runs: tuple[list[list[int]], list[list[int]], tandem_pb2.Load]) -> None:
    prompts, plain, mono_load = mono_runs
    with served(_worker("prefill", prefill_tp)) as prefill, \
            served(_worker("decode", decode_tp)) as decode:
        info = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5)
        got = []
        for p in prompts:  # one at a time, as mono ran them: the same batches, the same drafts
            tokens, last = pd_generate(prefill, decode, info.bootstrap_addr, p,
                                       sampling=_sampling())
            got.append(tokens)
            assert last.transfer.pages == -(-len(p) // 16) * prefill_tp * decode_tp
        pl, dl = _wait_drained(prefill), _wait_drained(decode)
    assert got == plain
    assert dl.prompt_tokens_computed == 0 and not pl.HasField("spec")
    # Decode drafted from its very first step, on the feature and head pages prefill sent.
    assert dl.spec.draft_tokens == mono_load.spec.draft_tokens
    assert dl.spec.accepted_tokens == mono_load.spec.accepted_tokens > 0


def test_a_prefill_without_the_drafter_is_refused_naming_speculative() -> None:
    prompt = _token_prompts()[0]
    with served(_worker("prefill", 1, "none")) as prefill, served(_worker("decode", 1)) as decode:
        info = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5)
        # Refused at registration, whichever side speaks first: the field and both labels.
        with pytest.raises(grpc.RpcError, match=r"speculative: '(eagle:1:\w+)?' != '(eagle)?"):
            pd_generate(prefill, decode, info.bootstrap_addr, prompt, sampling=_sampling())
        _wait_drained(decode)
