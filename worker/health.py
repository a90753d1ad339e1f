"""The worker's grpc.health.v1 service: Check and Watch of its one status (service "").

grpc's own asyncio servicer keeps a Watch stream open until the server cancels it. A gateway
watches each worker for as long as it lives, so when a worker stopped (a drain, a scale-down)
every open Watch was cancelled by `server.stop()`: grpc logged each as an ERROR traceback
("Exception not handled by _handle_exceptions ... CancelledError") and the stop waited out its
whole grace period. Here a Watch stream ends, with status OK, right after it has sent the
NOT_SERVING of the worker's shutdown (`stopping`), so the stop finds no call open.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerHealth(health_pb2_grpc.HealthServicer):
    """NOT_SERVING until `set` says otherwise; `stopping` makes it final and ends watches."""

    def __init__(self) -> None:
        self._status: int = NOT_SERVING  # a HealthCheckResponse.ServingStatus
        self._stopping = False
        self._changed = asyncio.Event()  # replaced at each change; the old one is set

    def set(self, status: int) -> None:
        """A new status (ignored once stopping: the shutdown's NOT_SERVING is final)."""
        if not self._stopping:
            self._change(status)

    def stopping(self) -> None:
        """The worker shuts down: NOT_SERVING, and every Watch stream ends after telling it."""
        self._stopping = True
        self._change(NOT_SERVING)

    def _change(self, status: int) -> None:
        self._status = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> Any:
        if request.service:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} "
                                "here; a worker reports its health as service ''")
        return health_pb2.HealthCheckResponse(status=self._status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # type: ignore[override]
                    context: grpc.aio.ServicerContext) -> None:
        if request.service:  # as the health protocol says: unknown, and watched as such
            await context.write(health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))
            await self._stopped()
            return
        sent: int | None = None
        while True:
            changed = self._changed  # before reading the status: a change after it sets this
            if self._status != sent:
                sent = self._status
                await context.write(health_pb2.HealthCheckResponse(status=sent))
            if self._stopping:
                return
            await changed.wait()

    async def _stopped(self) -> None:
        while not self._stopping:
            await self._changed.wait()
