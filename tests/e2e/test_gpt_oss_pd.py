"""GPT-OSS served disaggregated: PD = mono = transformers, pages and rings freed on every path.

Two levels, both with real engines and real transfer (Mooncake over loopback TCP):

- in process (the harness of tests/e2e/test_window_pd.py, page 4, chunk 16, window 8): prompts
  shorter and longer than the window and the chunk, the same prompt twice and prompts sharing a
  long prefix (prefill prefix hits with bounded replay); decode's tokens equal mono's and
  transformers', decode computes no prompt token, the room ships the full pages plus the ring's
  tail; abort and transfer failure leave no page, ring or room held;
- the acceptance command: `tandem serve --config configs/tiny-1p1d.yaml --model DIR` with
  `model.dtype=float32` (what `--dtype float32` sets), token-id prompts on `/v1/completions`,
  greedy text equal to transformers' `generate`, `cached_tokens` on a repeat, and every
  worker's GetLoad at zero used pages once the cluster drains.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.test_window_pd import (
    PAGE,
    Leg,
    _config,
    _drained,
    _params,
    _wait,
    measure_pd,
    running,
    submit_pd,
)
from tests.worker.gpt_oss_model import WINDOW, build_gpt_oss_checkpoint
from tests.worker.test_engine import hf_greedy
from transfer.backend import TransferFaults
from worker.request import Request

pytestmark = pytest.mark.slow
MAX_TOKENS = 8  # test_window_pd's legs decode this many


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("gpt-oss")
    yield path, build_gpt_oss_checkpoint(path)


def _prompts() -> tuple[list[list[int]], list[list[int]], list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(1, 128) for _ in range(44)]
    fresh = [[rng.randrange(1, 128) for _ in range(n)] for n in (5, WINDOW, 19, 37)]
    hits = [shared, shared + [rng.randrange(1, 128) for _ in range(3)], shared + [7] * 9]
    return fresh, hits, shared


def test_gpt_oss_pd_equals_mono_and_transformers(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, hf = checkpoint
    fresh, hits, shared = _prompts()
    prompts = fresh + [shared] + hits  # `shared` first, then again and extended: prefill hits
    with running(_config(path, "both")) as mono:
        want = []
        for i, p in enumerate(prompts):
            leg = Leg()
            mono.engine.submit(Request(f"m{i}", p, _params()), leg.sink)
            _wait(leg)
            want.append(leg.tokens)
    with running(_config(path, "prefill")) as prefill, running(_config(path, "decode")) as decode:
        shape = decode.engine.kv.shape
        assert shape.window_layers == (0, 2)
        for i, prompt in enumerate(prompts):
            pre, dec = submit_pd(prefill, decode, prompt, f"pd{i}")
            _wait(pre, dec)
            assert dec.finish == "length", dec.error
            assert dec.tokens == want[i] == hf_greedy(hf, prompt, MAX_TOKENS), (
                f"prompt {i} ({len(prompt)} tokens)"
            )
            tail = (len(prompt) - 1) // PAGE - max(0, len(prompt) - WINDOW) // PAGE + 1
            assert dec.transfer is not None
            assert dec.transfer["pages"] == -(-len(prompt) // PAGE) + tail
            assert (
                dec.transfer["bytes"]
                == -(-len(prompt) // PAGE) * shape.page_bytes + tail * shape.window_page_bytes
            )
            if i > len(fresh):  # a hit on `shared`'s pages: 2 window layers * (W-1) tokens re-fed
                hit = min(len(prompt) - 1, 44) // PAGE * PAGE
                assert pre.cached == (hit - 2 * (WINDOW - 1)) // PAGE * PAGE > 0
            else:
                assert pre.cached == 0
        assert decode.engine.scheduler.prompt_tokens_computed == 0, "decode re-fed the prompt"
        _drained(prefill)
        _drained(decode)


def test_gpt_oss_pd_frees_everything_on_abort_and_failure(
    checkpoint: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = checkpoint
    prompt = [random.Random(12).randrange(1, 128) for _ in range(30)]
    with running(_config(path, "prefill")) as prefill, running(_config(path, "decode")) as decode:
        manager = prefill.engine.scheduler.hooks.manager  # type: ignore[union-attr]
        manager.faults = TransferFaults(delay_ms=300)  # the room is in flight when decode aborts
        pre, dec = submit_pd(prefill, decode, prompt, "aborted")
        time.sleep(0.1)
        decode.engine.abort("aborted", "client left")
        _wait(pre, dec)
        assert dec.finish == "abort"
        manager.faults = TransferFaults(fail=1.0)
        pre, dec = submit_pd(prefill, decode, prompt, "failed")
        _wait(pre, dec)
        assert dec.finish == "error" and pre.finish == "error"
        manager.faults = TransferFaults()
        pre, dec = submit_pd(prefill, decode, prompt, "fine")
        _wait(pre, dec)
        assert dec.finish == "length"
        _drained(prefill)
        _drained(decode)


def test_tandem_serve_gpt_oss_1p1d_equals_transformers(
    checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """The acceptance path: the default 1P1D config, the checkpoint by --model, token-id prompts."""
    from orchestrator.launch.background import running_cluster

    path, hf = checkpoint
    rng = random.Random(13)
    prompts = [
        [rng.randrange(3, 128) for _ in range(n)] for n in (6, 21, 70)
    ]  # past the window and a page
    prompts.append(prompts[2] + [5, 6, 7])  # shares the 70-token prompt's pages: a prefill hit
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with running_cluster(
        "configs/tiny-1p1d.yaml", "model.dtype=float32", tmp=tmp_path, model=path
    ) as c:
        for i, prompt in enumerate(prompts):
            r = httpx.post(
                f"{c.url}/v1/completions",
                timeout=60,
                json={
                    "model": path.name,
                    "prompt": prompt,
                    "max_tokens": 10,
                    "temperature": 0,
                    "ignore_eos": True,
                    "skip_special_tokens": False,
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["completion_tokens"] == 10
            # As text: the gateway detokenizes the ids decode produced.
            want = tok.decode(hf_greedy(hf, prompt, 10), skip_special_tokens=False)
            assert body["choices"][0]["text"] == want, f"prompt {i}"
            cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert (cached > 0) == (i == 3), body["usage"]
        loads = c.wait_drained()
        assert all(ld.kv_used_pages == 0 for ld in loads.values())
        assert loads["decode-0"].prompt_tokens_computed == 0


def measure(out_dir: Path) -> None:
    """Figures for docs/gpt-oss.md: bytes shipped per request, the GPT-OSS checkpoint vs its
    same-size twin whose window never slides (every layer in full pages), and prefill tokens
    saved by bounded replay on shared prefixes."""
    models = {"gpt-oss": out_dir / "gpt-oss", "full": out_dir / "full"}
    build_gpt_oss_checkpoint(models["gpt-oss"])
    build_gpt_oss_checkpoint(models["full"], sliding_window=256)  # >= max_model_len: no ring
    measure_pd(models, vocab=128)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp))
