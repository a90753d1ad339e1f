"""PD with a hybrid sliding-window model equals mono, and frees pages and window rings
on every path.

Real engines and real transfer (Mooncake over loopback TCP, checksums on): a prefill worker and
a decode worker in this process, each with its engine loop on its own thread and the prefill
bootstrap service on gRPC; the test plays the gateway (one room, both legs submitted at once).
The model is the tiny hybrid Qwen2 of tests/worker/window_model.py: layer 0 full attention,
layers 1..3 a window of 8 tokens kept in a ring of 3 pages.

- prompts shorter and longer than the window, with and without prefix hits on prefill (bounded
  replay): decode's tokens equal mono's, and decode computed no prompt token;
- the room ships the full pages plus the ring's retained tail (at most ring_pages pages);
- finish, abort and transfer failure each leave both workers with no page and no ring held.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.worker.window_model import WINDOW, build_window_checkpoint
from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.roles import attach
from worker.sampling import SamplingParams

pytestmark = pytest.mark.slow

PAGE = 4
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(path: Path, role: str) -> WorkerConfig:
    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        port=_free_port(),
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=PAGE, num_pages=256, enable_prefix_cache=role != "decode"),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=16),
        transfer=TransferConfig(
            backend="mooncake",
            protocol="tcp",
            checksum=True,  # type: ignore[arg-type]
            transfer_timeout_s=5.0,
        ),
        num_threads=1,
    )


@dataclass
class Worker:
    engine: Engine
    info: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def running(config: WorkerConfig) -> Iterator[Worker]:
    engine = Engine(config)
    worker = Worker(engine)
    if config.role != "both":
        engine.set_hooks(attach(engine, config, worker.info))
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=30)
        if engine.scheduler.hooks is not None:
            engine.scheduler.hooks.close()


@dataclass
class Leg:
    tokens: list[int] = field(default_factory=list)
    cached: int = -1
    finish: str = ""
    error: str = ""
    transfer: dict[str, float] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, out: RequestOutput) -> None:
        self.tokens.extend(out.token_ids)
        if out.num_prompt_tokens:
            self.cached = out.num_cached_tokens
        if out.finished:
            self.finish, self.error, self.transfer = out.finish_reason, out.error, out.transfer
            self.done.set()


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def submit_pd(prefill: Worker, decode: Worker, prompt: list[int], rid: str) -> tuple[Leg, Leg]:
    """What the gateway does: one room, both legs at once."""
    room = secrets.randbits(64)
    pre, dec = Leg(), Leg()
    addr = prefill.info["bootstrap_addr"]
    prefill.engine.submit(
        Request(rid, list(prompt), _params(), room=room, bootstrap_addr=addr), pre.sink
    )
    decode.engine.submit(
        Request(rid, list(prompt), _params(), room=room, bootstrap_addr=addr), dec.sink
    )
    return pre, dec


def _wait(*legs: Leg) -> None:
    for leg in legs:
        assert leg.done.wait(60), "a leg never finished"


def _drained(worker: Worker) -> None:
    """No page, no ring, no room held: polled, since the loop thread frees them."""
    sched = worker.engine.scheduler
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        hooks = sched.hooks
        stats = sched.stats()
        busy = stats.used_pages or stats.window_used_pages or sched.has_work
        if not (busy or (hooks and hooks.has_work())):
            break
        time.sleep(0.05)
    # Read on this thread after the loop went quiet: every ledger balanced, nothing held.
    assert sched.cache.window is not None
    sched.assert_drained()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-window")
    build_window_checkpoint(path)
    return path


def _mono(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    with running(_config(checkpoint, "both")) as mono:
        outs = []
        for i, p in enumerate(prompts):
            leg = Leg()
            mono.engine.submit(Request(f"m{i}", p, _params()), leg.sink)
            _wait(leg)
            outs.append(leg.tokens)
    return outs


def test_window_pd_equals_mono_with_and_without_prefix_hits(checkpoint: Path) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(1, 97) for _ in range(44)]
    fresh = [
        [rng.randrange(1, 97) for _ in range(n)] for n in (5, WINDOW, 19, 37)
    ]  # < and > the window
    hits = [
        shared + [rng.randrange(1, 97) for _ in range(n)] for n in (3, 9)
    ]  # share 11 pages with `shared`
    prompts = fresh + [shared] + hits
    mono = _mono(checkpoint, prompts)
    with (
        running(_config(checkpoint, "prefill")) as prefill,
        running(_config(checkpoint, "decode")) as decode,
    ):
        ring_pages = decode.engine.kv.shape.ring_pages
        full_page = decode.engine.kv.shape.page_bytes
        ring_page = decode.engine.kv.shape.window_page_bytes
        for i, prompt in enumerate(prompts):
            pre, dec = submit_pd(prefill, decode, prompt, f"pd{i}")
            _wait(pre, dec)
            assert dec.finish == "length", dec.error
            assert dec.tokens == mono[i], f"prompt {i} ({len(prompt)} tokens)"
            # Full pages of the prompt plus the ring's tail: the pages of its last W tokens.
            tail = (len(prompt) - 1) // PAGE - max(0, len(prompt) - WINDOW) // PAGE + 1
            assert tail <= ring_pages
            assert dec.transfer is not None
            assert dec.transfer["pages"] == -(-len(prompt) // PAGE) + tail
            assert dec.transfer["bytes"] == -(-len(prompt) // PAGE) * full_page + tail * ring_page
            if prompt in hits:
                # Bounded replay: the hit ends at 44 tokens; 3 window layers * (W-1) are re-fed.
                assert pre.cached == (44 - 3 * (WINDOW - 1)) // PAGE * PAGE > 0
            else:
                assert pre.cached == 0
        assert decode.engine.scheduler.prompt_tokens_computed == 0, "decode re-fed the prompt"
        _drained(prefill)
        _drained(decode)


def test_window_pd_frees_pages_and_rings_on_abort_and_failure(checkpoint: Path) -> None:
    rng = random.Random(6)
    prompt = [rng.randrange(1, 97) for _ in range(30)]
    with (
        running(_config(checkpoint, "prefill")) as prefill,
        running(_config(checkpoint, "decode")) as decode,
    ):
        # Abort on decode while the room is in flight (prefill delayed so it is).
        prefill.engine.scheduler.hooks.manager.faults = TransferFaults(delay_ms=300)  # type: ignore[union-attr]
        pre, dec = submit_pd(prefill, decode, prompt, "aborted")
        time.sleep(0.1)
        decode.engine.abort("aborted", "client left")
        _wait(pre, dec)
        assert dec.finish == "abort"
        # A failed write: the room fails on both sides.
        prefill.engine.scheduler.hooks.manager.faults = TransferFaults(fail=1.0)  # type: ignore[union-attr]
        pre, dec = submit_pd(prefill, decode, prompt, "failed")
        _wait(pre, dec)
        assert dec.finish == "error" and "KV transfer failed" in dec.error
        assert pre.finish == "error"
        prefill.engine.scheduler.hooks.manager.faults = TransferFaults()  # type: ignore[union-attr]
        pre, dec = submit_pd(prefill, decode, prompt, "fine")  # and the pair still serves
        _wait(pre, dec)
        assert dec.finish == "length"
        assert decode.engine.scheduler.prompt_tokens_computed == 0
        _drained(prefill)
        _drained(decode)


def measure(out_dir: Path) -> None:
    """Figures for docs/hybrid-cache.md: bytes shipped per request, window model vs its all-full
    twin (same shapes, window off), and prefill tokens saved by bounded replay on shared prefixes.
    """
    models = {"window": out_dir / "window", "full": out_dir / "full"}
    build_window_checkpoint(models["window"])
    build_window_checkpoint(models["full"], window=False)
    measure_pd(models, vocab=97)


def measure_pd(models: dict[str, Path], vocab: int) -> None:
    """For each checkpoint, served 1P1D: bytes and pages shipped for prompts of 16-200 tokens,
    prefill tokens computed and cached on a shared-prefix workload, and KV memory per worker."""
    rng = random.Random(0)
    lengths = (16, 64, 128, 200)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    prefixes = [[rng.randrange(1, vocab) for _ in range(96)] for _ in range(4)]
    workload = [p + [rng.randrange(1, vocab) for _ in range(16)] for p in prefixes
                for _ in range(8)]
    width = max(len(name) for name in models)
    for name, path in models.items():
        with (
            running(_config(path, "prefill")) as prefill,
            running(_config(path, "decode")) as decode,
        ):
            for n, prompt in zip(lengths, prompts, strict=True):
                pre, dec = submit_pd(prefill, decode, prompt, f"b{n}")
                _wait(pre, dec)
                assert dec.transfer is not None
                print(
                    f"{name:{width}s} prompt {n:3d} tokens: {int(dec.transfer['pages']):3d} pages "
                    f"{int(dec.transfer['bytes']):8d} bytes shipped"
                )
            sched = prefill.engine.scheduler
            before, cached = sched.prompt_tokens_computed, 0
            for i, prompt in enumerate(workload):
                pre, dec = submit_pd(prefill, decode, prompt, f"w{i}")
                _wait(pre, dec)
                cached += pre.cached
            total = sum(len(p) for p in workload)
            computed = sched.prompt_tokens_computed - before
            print(
                f"{name:{width}s} shared-prefix workload: {total} prompt tokens, "
                f"prefill computed {computed}, cached_tokens {cached} "
                f"({100 * (total - computed) / total:.1f}% saved)"
            )
            kv = prefill.engine.kv
            print(
                f"{name:{width}s} KV memory per worker: {kv.nbytes()} bytes ({kv.shape.num_pages} "
                f"full pages of {kv.shape.page_bytes} B, {kv.shape.num_window_pages} window pages "
                f"of {kv.shape.window_page_bytes} B)"
            )


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        measure(Path(tmp))
