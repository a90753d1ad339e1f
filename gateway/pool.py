"""The gateway's workers: one gRPC channel each, their info, health and load.

Start-up: a task per worker calls `GetInfo` until the worker answers, then checks
`grpc.health.v1` every `health_interval_s` and refreshes `GetLoad` every `load_interval_s`.
Health has hysteresis: `health_fail_threshold` consecutive failed checks take a worker out,
`health_ok_threshold` consecutive SERVING answers bring it back. A request that fails with
UNAVAILABLE takes the worker out at once (it is "suspect" until the next good checks); a
client's error (INVALID_ARGUMENT) never counts against a worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.session import WorkerSession
from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.tls import aio_channel

log = logging.getLogger(__name__)

# Pool names: "workers" (mono, role both), "prefill", "decode".
POOLS_MONO = ("workers",)
POOLS_PD = ("prefill", "decode")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect quickly after a worker restarts; the health checks notice it within one interval.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(eq=False)
class Worker:
    """One worker as the gateway sees it. Mutated only by the pool's tasks and dispatch."""

    url: str  # host:port
    pool: str  # the pool it serves in: workers | prefill | decode
    channel: grpc.aio.Channel
    stub: tandem_pb2_grpc.WorkerStub
    health_stub: health_pb2_grpc.HealthStub
    session: WorkerSession  # the one stream every request to this worker rides
    info: tandem_pb2.WorkerInfo | None = None  # from GetInfo; None until reachable
    healthy: bool = False
    fails: int = 0  # consecutive failed health checks
    oks: int = 0  # consecutive SERVING answers
    load: tandem_pb2.Load = field(default_factory=tandem_pb2.Load)
    inflight: int = 0  # requests this gateway has on the worker right now

    def load_score(self) -> float:
        """Load for routing: the worker's queue, plus our own in-flight requests (GetLoad lags
        by up to one refresh, so a burst would otherwise all go to one worker), plus KV use."""
        ld = self.load
        kv = ld.kv_used_pages / ld.kv_total_pages if ld.kv_total_pages else 0.0
        return ld.running + ld.waiting + self.inflight + kv

    def as_json(self) -> dict[str, Any]:
        ld = self.load
        return {
            "url": self.url, "role": self.info.role if self.info else self.pool, "pool": self.pool,
            "healthy": self.healthy, "running": ld.running, "waiting": ld.waiting,
            "kv_used_pages": ld.kv_used_pages, "kv_total_pages": ld.kv_total_pages,
            "kv_cached_pages": ld.kv_cached_pages, "inflight": self.inflight,
        }


class WorkerPool:
    """All workers of all pools; owns their channels and background tasks."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        names = POOLS_PD if config.pd else POOLS_MONO
        addrs = {"workers": config.workers, "prefill": config.prefill, "decode": config.decode}
        self.pools: dict[str, list[Worker]] = {name: [self._make(url, name) for url in addrs[name]] for name in names}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()  # set whenever a worker's health flips (readiness waits)
        self._on_load: list[Any] = []  # callbacks(worker) after each GetLoad (metrics)

    def _make(self, url: str, pool: str) -> Worker:
        ch = aio_channel(url, self.config.tls, options=_CHANNEL_OPTIONS)
        stub = tandem_pb2_grpc.WorkerStub(ch)
        return Worker(url=url, pool=pool, channel=ch, stub=stub,
                      health_stub=health_pb2_grpc.HealthStub(ch),
                      session=WorkerSession(stub, url))

    def all(self) -> list[Worker]:
        return [w for ws in self.pools.values() for w in ws]

    def healthy(self, pool: str) -> list[Worker]:
        return [w for w in self.pools[pool] if w.healthy]

    def ready(self) -> bool:
        """At least one healthy worker in every pool a request needs."""
        return all(any(w.healthy for w in ws) for ws in self.pools.values())

    def infos(self) -> list[tandem_pb2.WorkerInfo]:
        return [w.info for w in self.all() if w.info is not None]

    def on_load(self, callback: Any) -> None:
        self._on_load.append(callback)

    # ---- lifecycle ----

    async def start(self) -> None:
        for w in self.all():
            self.spawn(self._watch(w))
            self.spawn(self._refresh_load(w))

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until `ready()`; the readiness signal is a health flip, not a sleep."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return self.ready()
        return True

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.session.close() for w in self.all()), return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.all()), return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine owned by the pool (kept referenced until it ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- health ----

    def mark_suspect(self, w: Worker) -> None:
        """A request saw UNAVAILABLE: take the worker out now; health checks bring it back."""
        if w.healthy:
            log.warning("worker %s (%s) marked unhealthy after UNAVAILABLE", w.url, w.pool)
        w.fails = self.config.health_fail_threshold
        w.oks = 0
        self._set_health(w, False)

    def _set_health(self, w: Worker, healthy: bool) -> None:
        if w.healthy != healthy:
            w.healthy = healthy
            log.info("worker %s (%s) is now %s", w.url, w.pool, "healthy" if healthy else "unhealthy")
            self._changed.set()

    def _record_check(self, w: Worker, ok: bool) -> None:
        cfg = self.config
        if ok:
            w.oks += 1
            w.fails = 0
            if not w.healthy and w.info is not None and w.oks >= cfg.health_ok_threshold:
                self._set_health(w, True)
        else:
            w.fails += 1
            w.oks = 0
            if w.healthy and w.fails >= cfg.health_fail_threshold:
                self._set_health(w, False)

    async def _get_info(self, w: Worker) -> bool:
        try:
            info = await w.stub.GetInfo(tandem_pb2.GetInfoRequest(), timeout=self.config.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("worker %s: GetInfo failed: %s", w.url, exc.code().name)
            return False
        expected = {"workers": "both"}.get(w.pool, w.pool)
        if info.role and info.role != expected:
            log.error("worker %s reports role %r but is configured in pool %r", w.url, info.role, w.pool)
        if w.pool == "prefill" and not info.bootstrap_addr:
            log.error("prefill worker %s reports no bootstrap_addr; decode workers cannot reach it", w.url)
        if w.info is not None and info.epoch != w.info.epoch:
            log.info("worker %s restarted (new epoch)", w.url)
        w.info = info
        return True

    async def _watch(self, w: Worker) -> None:
        interval = self.config.health_interval_s
        while not await self._get_info(w):
            await asyncio.sleep(interval)
        req = health_pb2.HealthCheckRequest(service="")
        while True:
            try:
                resp = await w.health_stub.Check(req, timeout=self.config.health_timeout_s)
                ok = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                ok = False
            if ok and not w.healthy:
                # Coming back may mean a restart: refresh its info (epoch, bootstrap address).
                ok = await self._get_info(w)
            self._record_check(w, ok)
            await asyncio.sleep(interval)

    async def _refresh_load(self, w: Worker) -> None:
        interval = self.config.load_interval_s
        req = tandem_pb2.GetLoadRequest()
        while True:
            if w.info is not None:  # first refresh as soon as the worker answered GetInfo
                try:
                    w.load = await w.stub.GetLoad(req, timeout=max(interval, 0.5))
                except grpc.aio.AioRpcError as exc:
                    log.debug("GetLoad on %s failed: %s", w.url, exc.code().name)
                else:
                    for cb in self._on_load:
                        cb(w)
            await asyncio.sleep(interval if w.info is not None else self.config.health_interval_s / 2)
