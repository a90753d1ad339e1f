"""PD with heterogeneous TP, both directions, equals mono token for token.

Real workers (gRPC servers, engines, Mooncake over loopback TCP), a TP=2 worker's second rank
a real spawned process joined by gloo. The gateway's part (two Generate calls sharing a room,
the decode call carrying the prefill worker's bootstrap address list from GetInfo) is played
by the test, so no tokenizer is needed and the tiny random checkpoint suffices.

- prefill TP=2 → decode TP=1: decode registers with both prefill ranks; each writes its head.
- prefill TP=1 → decode TP=2: both decode ranks register; prefill splits its heads per rank.
- attention DP (dp_size 2) on either side: a room lives on one DP group's ranks (prefill keeps
  room r in group r % 2 and lists its groups ';'-separated; decode picks its least busy group).
Every room succeeds on every rank, moves pages, and both workers drain (no pages, no rooms).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from transfer.config import TransferConfig
from worker.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig
from worker.server import serve

pytestmark = pytest.mark.slow

PROMPT_LENS = (5, 13, 22, 31)  # 2..8 pages of 4 tokens; the last page partly filled
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(path: Path, role: str, tp: int, dp: int = 1) -> WorkerConfig:
    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        port=_free_port(),
        model=ModelConfig(path=str(path), dtype="float32"),
        cache=CacheConfig(page_size=4, num_pages=64, enable_prefix_cache=role != "decode"),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=16),
        parallel=ParallelConfig(tp_size=tp, dp_size=dp),
        transfer=TransferConfig(backend="mooncake", protocol="tcp", checksum=True),  # type: ignore[arg-type]
        num_threads=1,
    )


@contextlib.contextmanager
def served(config: WorkerConfig) -> Iterator[tandem_pb2_grpc.WorkerStub]:
    """A worker server on its own thread and event loop, SERVING before we yield."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(serve(config, stop))
        except BaseException as exc:  # surfaced below, not swallowed
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{config.port}")
    health = health_pb2_grpc.HealthStub(channel)
    try:
        for _ in range(1200):
            if failed:
                raise AssertionError(f"{config.role} worker failed to start") from failed[0]
            with contextlib.suppress(grpc.RpcError):
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    break
            threading.Event().wait(0.05)
        else:
            raise AssertionError(f"{config.role} worker never became SERVING")
        yield tandem_pb2_grpc.WorkerStub(channel)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        channel.close()
    assert not thread.is_alive(), f"{config.role} worker did not stop"
    assert not failed, failed


def _sampling() -> tandem_pb2.SamplingParams:
    return tandem_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def pd_generate(
    prefill: tandem_pb2_grpc.WorkerStub,
    decode: tandem_pb2_grpc.WorkerStub,
    bootstrap: str,
    prompt: list[int],
    room: int | None = None,
    sampling: tandem_pb2.SamplingParams | None = None,
) -> tuple[list[int], tandem_pb2.GenerateResponse]:
    """What the gateway does for one request: both legs at once, one room (this module's
    sampling unless another is given)."""
    disagg = tandem_pb2.DisaggParams(room=room or secrets.randbits(64), bootstrap_addr=bootstrap)
    req = tandem_pb2.GenerateRequest(
        request_id="pd", prompt_token_ids=prompt, sampling=sampling or _sampling(), disagg=disagg
    )
    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(lambda: list(prefill.Generate(req, timeout=60)))
        dec = pool.submit(lambda: list(decode.Generate(req, timeout=60)))
        decode_msgs = dec.result()
        pre.result()  # the prefill leg must end cleanly too
    return [t for m in decode_msgs for t in m.token_ids], decode_msgs[-1]


def _wait_drained(stub: tandem_pb2_grpc.WorkerStub) -> tandem_pb2.Load:
    for _ in range(400):
        load = stub.GetLoad(tandem_pb2.GetLoadRequest(), timeout=5)
        if not (load.kv_used_pages or load.running or load.waiting or any(load.rooms.values())):
            return load
        threading.Event().wait(0.05)
    raise AssertionError(f"worker not drained: {load}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.worker.conftest import build_tiny_checkpoint

    path = tmp_path_factory.mktemp("qwen3")
    build_tiny_checkpoint(
        path, "qwen3", max_position_embeddings=64
    )  # 2 kv heads: one per TP=2 rank
    return path


@pytest.fixture(scope="module")
def prompts_and_mono(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(17)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in PROMPT_LENS]
    with served(_config(checkpoint, "both", 1)) as mono:
        outs = []
        for p in prompts:
            req = tandem_pb2.GenerateRequest(
                request_id="mono", prompt_token_ids=p, sampling=_sampling()
            )
            outs.append([t for m in mono.Generate(req, timeout=60) for t in m.token_ids])
    return prompts, outs


@pytest.mark.parametrize(
    ("prefill_tp", "prefill_dp", "decode_tp", "decode_dp"),
    # one multi-rank side per case: both workers share this process's default group
    [(2, 1, 1, 1), (1, 1, 2, 1), (1, 2, 1, 1), (1, 1, 1, 2)],
    ids=["p-tp2-d-tp1", "p-tp1-d-tp2", "p-dp2-d-tp1", "p-tp1-d-dp2"],
)
def test_pd_hetero_tp_equals_mono(
    prefill_tp: int,
    prefill_dp: int,
    decode_tp: int,
    decode_dp: int,
    checkpoint: Path,
    prompts_and_mono: tuple[list[list[int]], list[list[int]]],
) -> None:
    prompts, mono = prompts_and_mono
    with (
        served(_config(checkpoint, "prefill", prefill_tp, prefill_dp)) as prefill,
        served(_config(checkpoint, "decode", decode_tp, decode_dp)) as decode,
    ):
        info = prefill.GetInfo(tandem_pb2.GetInfoRequest(), timeout=5)
        assert info.tp_size == prefill_tp
        groups = info.bootstrap_addr.split(";")  # one per prefill DP group
        assert [len(g.split(",")) for g in groups] == [
            prefill_tp
        ] * prefill_dp  # a bootstrap service per rank
        # All at once, rooms alternating between the prefill DP groups (room % 2), so both
        # groups on both sides serve and decode's group choice sees a busy group.
        rooms = [(secrets.randbits(63) << 1) | (i % 2) for i in range(len(prompts))]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda a: pd_generate(prefill, decode, info.bootstrap_addr, *a),
                    zip(prompts, rooms, strict=True),
                )
            )
        got, last = [r[0] for r in results], [r[1] for r in results]
        assert got == mono
        for p, end in zip(prompts, last, strict=True):
            # Every page went from every prefill rank to every decode rank (2 kv heads: each pair
            # shares one), and the counters sum over (prefill rank, decode rank) pairs.
            assert end.transfer.pages == -(-len(p) // 4) * prefill_tp * decode_tp
            assert end.transfer.bytes > 0
        pl, dl = _wait_drained(prefill), _wait_drained(decode)
        assert dl.prompt_tokens_computed == 0  # decode never ran a prompt
        assert pl.transfer_bytes == dl.transfer_bytes > 0
