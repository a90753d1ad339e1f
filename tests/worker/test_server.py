"""The worker's gRPC surface: health, GetInfo, Generate (stream), errors, Abort, GetLoad."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from worker import server as worker_server
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.server import serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def frozen() -> list[int]:
    """serve()'s calls of freeze_startup_heap in this module's worker."""
    return []


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, frozen: list[int]
) -> Iterator[tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel]]:
    from tests.worker.conftest import build_tiny_checkpoint

    path: Path = tmp_path_factory.mktemp("ckpt")
    build_tiny_checkpoint(path, "llama", max_position_embeddings=64)
    config = WorkerConfig(
        port=free_port(),
        model=ModelConfig(path=str(path)),
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=32),
    )
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    # serve() freezes the startup heap when ready (protocol/gc_heap.py): counted here instead,
    # so that this test process's heap is not frozen
    patch = pytest.MonkeyPatch()
    patch.setattr(worker_server, "freeze_startup_heap", lambda: frozen.append(len(frozen)))
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(serve(config, stop)), daemon=True
    )
    thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{config.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for _ in range(600):
        try:
            if (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            ):
                break
        except grpc.RpcError:
            pass
        threading.Event().wait(0.05)
    else:
        raise AssertionError("worker never became SERVING")
    yield tandem_pb2_grpc.WorkerStub(channel), channel
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=20)
    channel.close()
    patch.undo()


def test_the_heap_is_frozen_once_before_serving(
    worker: tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel], frozen: list[int]
) -> None:
    assert frozen == [0]


def gen(prompt: list[int], **sampling: object) -> tandem_pb2.GenerateRequest:
    params = {"max_tokens": 5, "ignore_eos": True, **sampling}
    return tandem_pb2.GenerateRequest(
        request_id="t", prompt_token_ids=prompt, sampling=tandem_pb2.SamplingParams(**params)
    )


def test_info_and_generate_stream(worker: tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel]) -> None:
    stub, _ = worker
    info = stub.GetInfo(tandem_pb2.GetInfoRequest())
    assert (
        info.role == "both"
        and info.max_model_len == 64
        and info.vocab_size == 97
        and info.epoch != 0
    )
    msgs = list(stub.Generate(gen([1, 2, 3, 4, 5, 6], logprobs=True, top_logprobs=2)))
    tokens = [t for m in msgs for t in m.token_ids]
    assert len(tokens) == 5 and msgs[-1].finish_reason == "length"
    assert msgs[0].num_prompt_tokens == 6
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
    load = stub.GetLoad(tandem_pb2.GetLoadRequest())
    assert load.kv_used_pages == 0 and load.running == 0 and load.kv_total_pages == 64


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (gen([]), "empty"),
        (gen([1, 2, 500]), "vocabulary"),
        (gen([1] * 60, max_tokens=10), "context length"),
        (gen([1, 2], max_tokens=0), "max_tokens"),
        (gen([1, 2], temperature=-1.0), "temperature"),
        (gen([1, 2], top_p=1.5), "top_p"),
    ],
)
def test_bad_requests_are_invalid_argument(
    worker: tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel],
    request_: tandem_pb2.GenerateRequest,
    fragment: str,
) -> None:
    stub, _ = worker
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


def test_cancel_and_abort_free_pages(
    worker: tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel],
) -> None:
    stub, _ = worker
    stream = stub.Generate(gen([1, 2, 3, 4, 5], max_tokens=50))
    next(stream)
    stream.cancel()
    aborted = stub.Generate(
        tandem_pb2.GenerateRequest(
            request_id="to-abort",
            prompt_token_ids=[3, 4, 5],
            sampling=tandem_pb2.SamplingParams(max_tokens=55, ignore_eos=True),
        )
    )
    next(aborted)
    assert stub.Abort(tandem_pb2.AbortRequest(request_id="to-abort")).found
    rest = list(aborted)
    assert rest[-1].finish_reason == "abort"
    assert not stub.Abort(tandem_pb2.AbortRequest(request_id="unknown")).found
    for _ in range(200):
        load = stub.GetLoad(tandem_pb2.GetLoadRequest())
        if load.kv_used_pages == 0 and load.running == 0:
            break
        threading.Event().wait(0.02)
    assert load.kv_used_pages == 0 and load.running == 0 and load.waiting == 0
