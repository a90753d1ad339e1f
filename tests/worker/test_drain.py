"""A worker's identity in GetInfo, its bind failure, and its drain (the Drain RPC and the
deadline), on a real in-process worker serving a tiny checkpoint."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.identity import model_fingerprint
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.server import BindError, serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.worker.conftest import build_tiny_checkpoint

    path: Path = tmp_path_factory.mktemp("ckpt")
    build_tiny_checkpoint(path, "llama", max_position_embeddings=512)
    return path


@dataclass
class Running:
    stub: tandem_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    thread: threading.Thread
    stop: asyncio.Event
    loop: asyncio.AbstractEventLoop
    errors: list[BaseException]


@pytest.fixture
def make_worker(checkpoint: Path) -> Iterator:
    started: list[tuple[Running, grpc.Channel]] = []

    def start(**kw: object) -> Running:
        config = WorkerConfig(
            port=free_port(),
            model=ModelConfig(path=str(checkpoint)),
            cache=CacheConfig(page_size=4, num_pages=256),
            scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=32),
            cluster_id="c1",
            replica=3,
            **kw,
        )
        loop, stop, errors = asyncio.new_event_loop(), asyncio.Event(), []

        def run() -> None:
            try:
                loop.run_until_complete(serve(config, stop))
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{config.port}")
        running = Running(
            tandem_pb2_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
            thread,
            stop,
            loop,
            errors,
        )
        started.append((running, channel))
        deadline = time.monotonic() + 60
        while status(running) != "SERVING":
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)
        return running

    yield start
    for running, channel in started:
        if running.thread.is_alive():
            running.loop.call_soon_threadsafe(running.stop.set)
            running.thread.join(timeout=20)
        channel.close()


def status(w: Running) -> str:
    try:
        reply = w.health.Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def long_request(rid: str, max_tokens: int) -> tandem_pb2.GenerateRequest:
    return tandem_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling=tandem_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def test_getinfo_reports_identity(make_worker, checkpoint: Path) -> None:
    w = make_worker()
    info = w.stub.GetInfo(tandem_pb2.GetInfoRequest())
    assert (info.cluster_id, info.role, info.replica, info.draining) == ("c1", "both", 3, False)
    assert info.model_fingerprint == model_fingerprint(checkpoint.name, str(checkpoint))
    assert info.contract_hash == ""  # mono: no KV transfer, no contract


def test_drain_finishes_held_requests_refuses_new_ones_frees_pages_and_exits(make_worker) -> None:
    w = make_worker()
    stream = w.stub.Generate(long_request("held", 120))
    first = next(stream)
    assert first.token_ids
    reply = w.stub.Drain(tandem_pb2.DrainRequest(reason="test"))
    assert reply.running + reply.waiting == 1
    assert status(w) == "NOT_SERVING"  # at once: routers stop sending
    assert w.stub.GetInfo(tandem_pb2.GetInfoRequest()).draining
    with pytest.raises(grpc.RpcError) as refused:
        list(w.stub.Generate(long_request("new", 3)))
    assert (
        refused.value.code() == grpc.StatusCode.UNAVAILABLE
        and "draining" in refused.value.details()
    )
    rest = list(stream)  # the held request runs to its end
    tokens = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert rest[-1].finish_reason == "length" and tokens == 120
    w.thread.join(timeout=20)
    assert not w.thread.is_alive(), "a drained worker exits"
    assert not w.errors
    assert status(w) == "UNREACHABLE"


def test_drain_deadline_aborts_what_is_left(make_worker) -> None:
    w = make_worker(drain_timeout_s=0.05)
    stream = w.stub.Generate(long_request("too-long", 500))
    next(stream)
    t0 = time.monotonic()
    w.stub.Drain(tandem_pb2.DrainRequest())
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"  # aborted at the deadline, the caller told so
    w.thread.join(timeout=20)
    assert not w.thread.is_alive() and time.monotonic() - t0 < 10


def test_a_worker_that_cannot_bind_fails_before_loading_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model path does not exist: only a bind that comes first fails with BindError.
        config = WorkerConfig(port=port, model=ModelConfig(path=str(tmp_path / "missing")))
        t0 = time.monotonic()
        with pytest.raises(BindError, match=rf"cannot bind 127.0.0.1:{port}: the port is in use"):
            asyncio.run(serve(config, asyncio.Event()))
        assert time.monotonic() - t0 < 5


def test_a_drain_deadline_says_so_on_the_session_stream(make_worker) -> None:
    """The gateway's stream: the request the deadline ends comes back "abort" with the
    worker's reason beside it, so the client reads that the worker was drained, not that its
    request was aborted by nobody."""
    from tests.worker.test_session import Stream

    w = make_worker(drain_timeout_s=0.05)
    s = Stream(w.stub)
    s.submit((1, long_request("too-long", 500)))
    while 1 not in next(s.call).slots:  # its first tokens: it runs
        pass
    w.stub.Drain(tandem_pb2.DrainRequest())
    s.read_until({1})
    end = s.ended[1]
    assert end.finish_reason == "abort" and end.status_code == 0
    assert "drain timed out after 0.05 s" in end.error, end
    s.close()


def test_a_health_watch_ends_when_the_worker_stops(make_worker, caplog) -> None:
    """A gateway watches each worker's health for as long as it lives. When the worker drains
    and exits, the Watch stream tells NOT_SERVING and then ends with OK: before, the server's
    stop cancelled it (grpc logged an ERROR traceback, 'Exception not handled ...
    CancelledError') and waited out its 2 s grace for it."""
    w = make_worker()
    watch = w.health.Watch(health_pb2.HealthCheckRequest())
    seen = [health_pb2.HealthCheckResponse.ServingStatus.Name(next(watch).status)]
    t0 = time.monotonic()
    w.stub.Drain(tandem_pb2.DrainRequest(reason="test"))
    seen += [health_pb2.HealthCheckResponse.ServingStatus.Name(m.status) for m in watch]
    assert seen == ["SERVING", "NOT_SERVING"]  # and the stream ended without an error
    w.thread.join(timeout=20)
    assert not w.thread.is_alive() and not w.errors
    assert time.monotonic() - t0 < 1.9, "the stop waited for a call still open"
    assert "Exception not handled" not in caplog.text
