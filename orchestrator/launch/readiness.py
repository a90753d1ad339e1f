"""Readiness signals with deadlines: gRPC health of workers, HTTP /health of the gateway.

A worker says it is ready by switching its standard grpc.health.v1 status (service "") to
SERVING. `HealthWatch` subscribes to that status with `Watch` (a server push, so no polling
and no sleeps) on a daemon thread and sets an event the launcher waits on. A SERVING answer
is not enough: `identity_problem` then asks the worker who it is (GetInfo) and compares it
with the worker the launcher started, so another cluster's worker on that address is refused.
The gateway has only an HTTP endpoint, so `http_ready` polls it with a short interval up to a
deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.identity import WorkerIdentity
from protocol.tls import TLSConfig, channel

_SERVING = health_pb2.HealthCheckResponse.SERVING


class HealthWatch:
    """Follows one worker's gRPC health status; `ready` is set once it reports SERVING."""

    def __init__(self, address: str, wake: threading.Event, tls: TLSConfig | None = None) -> None:
        self.address = address
        self.ready = threading.Event()
        self.last_status = "no answer yet"  # for the timeout message
        self._wake = wake  # set on every status change so the launcher re-checks at once
        self._channel = channel(address, tls or TLSConfig())
        self._call: grpc.Future | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"health-{address}", daemon=True)

    def start(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._thread.start()

    def _run(self) -> None:
        stub = health_pb2_grpc.HealthStub(self._channel)
        # wait_for_ready: the call waits for the server's port to open instead of failing
        # at once with UNAVAILABLE while the worker is still loading.
        call = stub.Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=self._timeout_s, wait_for_ready=True
        )
        with self._lock:
            if self._closed:
                call.cancel()
                return
            self._call = call
        try:
            for reply in call:
                self.last_status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if reply.status == _SERVING:
                    self.ready.set()
                    self._wake.set()
                    return  # readiness is all the launcher needs; liveness is the process
                self._wake.set()
        except grpc.RpcError as exc:
            if not self._closed:
                self.last_status = f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()
            self._wake.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._call is not None:
                self._call.cancel()
        self._channel.close()


def http_ready(
    url: str,
    deadline: float,
    keep_waiting: Callable[[], bool],
    interrupt: threading.Event,
    interval_s: float = 0.1,
) -> bool:
    """Poll GET `url` until it answers 200 (True); False once `deadline` (time.monotonic)
    passes or `keep_waiting()` turns False. `interrupt` cuts an interval short (stop request)."""
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline and keep_waiting():
            try:
                if client.get(url).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass  # not listening yet: the next poll decides, the deadline bounds it
            interrupt.wait(interval_s)
    return False


def identity_problem(
    address: str, expected: WorkerIdentity, tls: TLSConfig | None = None, timeout_s: float = 5.0
) -> str:
    """'' when the worker at `address` is `expected`; else the one-line refusal."""
    with channel(address, tls or TLSConfig()) as ch:
        try:
            info = tandem_pb2_grpc.WorkerStub(ch).GetInfo(
                tandem_pb2.GetInfoRequest(), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return (
                f"refusing the worker at {address}: it answers health but not GetInfo "
                f"({exc.code().name}); expected {expected.describe()}"
            )
    return expected.mismatch(address, info)
