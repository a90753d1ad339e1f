"""PD with DeepSeek-V3 (MLA latent pages) equals mono and transformers, and frees everything.

Real workers (gRPC servers, engines, Mooncake over loopback TCP with checksums); the test plays
the gateway (two Generate calls sharing a room), so token ids are compared exactly. The model is
tests/worker/deepseek_model.py's tiny random DeepSeek-V3 (MLA with q_lora, MoE, an MTP layer).

- 1P1D: prompts shorter and longer than a chunk (16) and prefix hits on prefill (a repeated
  prompt, a shared long prefix): decode's tokens equal mono's and transformers' greedy
  `generate`; the room ships the prompt's latent pages (page_bytes = layers x page x latent);
  decode runs no prompt token; both workers drain (GetLoad: no page, no room, nothing queued);
- heterogeneous TP (prefill TP2 -> decode TP1 and TP1 -> TP2): each decode rank receives exactly
  one copy of every page (the latent is the same on every rank);
- a failed transfer and a client that leaves mid-room free every page on both sides.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from protocol import tandem_pb2, tandem_pb2_grpc
from tests.e2e.test_hetero_tp import _config, _wait_drained, served
from tests.worker.deepseek_model import LATENT_DIM, build_deepseek_checkpoint

pytestmark = pytest.mark.slow

PAGE, LAYERS, MAX_TOKENS = 4, 3, 8
PAGE_BYTES = LAYERS * PAGE * LATENT_DIM * 4  # float32 latent rows of every layer for 4 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek-v3")
    return path, build_deepseek_checkpoint(path, mtp=True, tokenizer=False)


def _sampling(max_tokens: int = MAX_TOKENS) -> tandem_pb2.SamplingParams:
    return tandem_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate_pd(
    prefill: tandem_pb2_grpc.WorkerStub,
    decode: tandem_pb2_grpc.WorkerStub,
    bootstrap: str,
    prompt: list[int],
) -> tuple[list[tandem_pb2.GenerateResponse], list[tandem_pb2.GenerateResponse]]:
    """Both legs at once, one room, as the gateway does: (prefill's messages, decode's)."""
    disagg = tandem_pb2.DisaggParams(room=secrets.randbits(64), bootstrap_addr=bootstrap)
    req = tandem_pb2.GenerateRequest(
        request_id=f"mla-{secrets.token_hex(4)}",
        prompt_token_ids=prompt,
        sampling=_sampling(),
        disagg=disagg,
    )
    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(lambda: list(prefill.Generate(req, timeout=60)))
        dec = pool.submit(lambda: list(decode.Generate(req, timeout=60)))
        return pre.result(), dec.result()


def _tokens(msgs: list[tandem_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(21)
    shared = [rng.randrange(3, 128) for _ in range(28)]  # 7 pages
    fresh = [[rng.randrange(3, 128) for _ in range(n)] for n in (3, 13, 45)]
    return [
        *fresh,
        shared + [9, 8, 7],
        shared + [rng.randrange(3, 128) for _ in range(10)],
        fresh[2],
    ]


@pytest.fixture(scope="module")
def reference(model: tuple[Path, torch.nn.Module], prompts: list[list[int]]) -> list[list[int]]:
    """Mono's greedy tokens, which must be transformers' too."""
    path, hf = model
    with served(_config(path, "both", 1)) as mono:
        outs = []
        for p in prompts:
            req = tandem_pb2.GenerateRequest(
                request_id="mono", prompt_token_ids=p, sampling=_sampling()
            )
            outs.append([t for m in mono.Generate(req, timeout=60) for t in m.token_ids])
    for p, got in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )[0, len(p) :].tolist()
        assert got == want
    return outs


def test_mla_pd_equals_mono_and_transformers_with_prefix_hits(
    model: tuple[Path, torch.nn.Module], prompts: list[list[int]], reference: list[list[int]]
) -> None:
    path, _ = model
    with (
        served(_config(path, "prefill", 1)) as prefill,
        served(_config(path, "decode", 1)) as decode,
    ):
        bootstrap = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5).bootstrap_addr
        cached = []
        for prompt, want in zip(
            prompts, reference, strict=True
        ):  # one by one: later ones hit the cache
            pre, dec = generate_pd(prefill, decode, bootstrap, prompt)
            assert _tokens(dec) == want, f"{len(prompt)}-token prompt"
            assert _tokens(pre) == want[:1]  # prefill samples the first token, decode the rest
            pages = -(-len(prompt) // PAGE)
            assert (dec[-1].transfer.pages, dec[-1].transfer.bytes) == (pages, pages * PAGE_BYTES)
            cached.append(pre[0].num_cached_tokens)
        # The shared 28-token prefix (7 pages) and the repeated 45-token prompt (11 full pages) hit.
        assert cached == [0, 0, 0, 0, 28, 44]
        pl, dl = _wait_drained(prefill), _wait_drained(decode)
        assert dl.prompt_tokens_computed == 0  # decode never ran a prompt
        assert (
            pl.transfer_bytes
            == dl.transfer_bytes
            == sum(-(-len(p) // PAGE) for p in prompts) * PAGE_BYTES
        )


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["p-tp2-d-tp1", "p-tp1-d-tp2"]
)
def test_mla_hetero_tp_ships_one_copy_per_decode_rank(
    prefill_tp: int,
    decode_tp: int,
    model: tuple[Path, torch.nn.Module],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    path, _ = model
    with (
        served(_config(path, "prefill", prefill_tp)) as prefill,
        served(_config(path, "decode", decode_tp)) as decode,
    ):
        bootstrap = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5).bootstrap_addr
        assert len(bootstrap.split(",")) == prefill_tp
        with ThreadPoolExecutor(len(prompts)) as pool:  # all at once
            results = list(pool.map(lambda p: generate_pd(prefill, decode, bootstrap, p), prompts))
        for prompt, want, (_, dec) in zip(prompts, reference, results, strict=True):
            assert _tokens(dec) == want
            # Summed over (prefill rank, decode rank) pairs: one copy of each page per decode rank,
            # not prefill_tp of them (a K/V model ships every rank's heads).
            pages = -(-len(prompt) // PAGE)
            assert dec[-1].transfer.pages == pages * decode_tp
            assert dec[-1].transfer.bytes == pages * decode_tp * PAGE_BYTES
        pl, dl = _wait_drained(prefill), _wait_drained(decode)
        assert dl.prompt_tokens_computed == 0
        assert pl.transfer_bytes == dl.transfer_bytes > 0


@contextlib.contextmanager
def _faults(monkeypatch: pytest.MonkeyPatch, spec: str) -> Iterator[None]:
    """TANDEM_TRANSFER_FAULTS for the workers started inside (parsed at manager start)."""
    with monkeypatch.context() as m:
        m.setenv("TANDEM_TRANSFER_FAULTS", spec)
        yield


def test_mla_pd_frees_pages_on_failure_and_abort(
    model: tuple[Path, torch.nn.Module], prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = model
    prompt = prompts[2]
    with (
        _faults(monkeypatch, "fail=1.0"),
        served(_config(path, "prefill", 1)) as prefill,
        served(_config(path, "decode", 1)) as decode,
    ):
        bootstrap = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5).bootstrap_addr
        with pytest.raises(grpc.RpcError) as failed:
            generate_pd(prefill, decode, bootstrap, prompt)
        assert "KV transfer failed" in str(failed.value.details())  # type: ignore[attr-defined]
        _wait_drained(prefill), _wait_drained(decode)
    with (
        _faults(monkeypatch, "delay_ms=400"),
        served(_config(path, "prefill", 1)) as prefill,
        served(_config(path, "decode", 1)) as decode,
    ):
        bootstrap = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5).bootstrap_addr
        room = secrets.randbits(64)
        req = tandem_pb2.GenerateRequest(
            request_id="leaves",
            prompt_token_ids=prompt,
            sampling=_sampling(),
            disagg=tandem_pb2.DisaggParams(room=room, bootstrap_addr=bootstrap),
        )
        with ThreadPoolExecutor(2) as pool:
            legs = [
                pool.submit(lambda s=stub: list(s.Generate(req, timeout=60)))
                for stub in (prefill, decode)
            ]
            threading.Event().wait(0.2)  # the room is in flight: its writes are delayed
            for stub in (decode, prefill):  # what the gateway does when the client leaves
                stub.Abort(tandem_pb2.AbortRequest(request_id="leaves", room=room), timeout=5)
            ends = []
            for leg in legs:
                try:
                    ends.append(leg.result(timeout=30)[-1].finish_reason)
                except grpc.RpcError as e:
                    ends.append(e.code().name)  # type: ignore[attr-defined]
        assert ends[1] == "abort", ends
        _wait_drained(prefill), _wait_drained(decode)


def measure(out_dir: Path) -> None:
    """Figures for docs/transfer.md: KV bytes shipped per request, read from the transfer
    counters, for the tiny DeepSeek-V3 (MLA latent pages) and dense Qwen3 twins with the same
    layers, hidden size and query heads (MHA: 4 kv heads; GQA: 2), TP1 -> TP1 and TP1 -> TP2."""
    from tests.worker.deepseek_model import build_dense_twin

    models = {"deepseek-mla": out_dir / "mla", "qwen3-mha": out_dir / "mha",
              "qwen3-gqa": out_dir / "gqa"}
    build_deepseek_checkpoint(models["deepseek-mla"], tokenizer=False)
    build_dense_twin(models["qwen3-mha"], kv_heads=4)
    build_dense_twin(models["qwen3-gqa"], kv_heads=2)
    rng = random.Random(0)
    prompts = {n: [rng.randrange(3, 128) for _ in range(n)] for n in (16, 64, 200)}
    for name, path in models.items():
        for decode_tp in (1, 2):
            with served(_config(path, "prefill", 1)) as prefill, \
                    served(_config(path, "decode", decode_tp)) as decode:
                bootstrap = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5).bootstrap_addr
                for n, prompt in prompts.items():
                    _, dec = generate_pd(prefill, decode, bootstrap, prompt)
                    t = dec[-1].transfer
                    print(f"{name:12s} TP1->TP{decode_tp} prompt {n:3d} tokens: {t.pages:3d} pages "
                          f"{t.bytes:8d} bytes ({t.bytes / n:6.0f} B/token)")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp))
