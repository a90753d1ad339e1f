"""The gateway's workers: one gRPC channel each, their identity, health, load and membership.

Watching: a task per worker calls `GetInfo` and `grpc.health.v1` Check every
`health_interval_s`, and refreshes `GetLoad` every `load_interval_s`. Every GetInfo answer is
checked against the identity the gateway expects (cluster id, role, model fingerprint, and
one KV contract hash across the PD pools; the launcher checks replicas), so a worker of
another cluster or model answering on an expected address, at start or after a reconnect, is
refused with one line and never routed to. A health Watch stream takes a worker out the moment
it says NOT_SERVING (a drain starting), or its connection drops: then a check runs at once, and
whatever answers at the address next is routed to only once it has passed the identity check
(between two periodic checks, another cluster's worker on the port got requests).
Health has hysteresis for failed checks:
`health_fail_threshold` consecutive failures take a worker out, `health_ok_threshold`
consecutive good checks bring it back; an explicit NOT_SERVING (a draining worker) takes it out
at once. A request that fails with UNAVAILABLE takes the worker out at once too; a client's
error (INVALID_ARGUMENT) never counts against a worker.

Membership at run time: `add` (POST /workers) admits a worker after the identity check;
`remove` (DELETE /workers/{url}) stops routing to it at once, asks it to drain (`Drain`),
waits until the gateway has no request on it and the worker has exited (bounded by
`drain_timeout_s`), then drops it and closes its channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from gateway.config import GatewayConfig
from gateway.waits import wait_event
from gateway.workers import (
    ROLE_OF_POOL,
    IdentityRefused,
    Membership,
    Worker,
    WorkerState,
    WorkerUnreachable,
    listed_elsewhere,
    open_worker,
)
from protocol import tandem_pb2

log = logging.getLogger(__name__)
# The pool's vocabulary (defined in gateway/workers.py; dispatch and the routes import it here).
__all__ = [
    "IdentityRefused",
    "Membership",
    "Worker",
    "WorkerPool",
    "WorkerState",
    "WorkerUnreachable",
]

# Pool names: "workers" (mono, role both), "prefill", "decode".
POOLS_MONO = ("workers",)
POOLS_PD = ("prefill", "decode")
_REMOVE_GRACE_S = 5.0  # past the drain timeout: time for the worker to exit
_REMOVE_POLL_S = 0.05  # in-flight counts and exits have no event to wait on

class WorkerPool:
    """All workers of all pools; owns their channels and background tasks."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        names = POOLS_PD if config.pd else POOLS_MONO
        addrs = {"workers": config.workers, "prefill": config.prefill, "decode": config.decode}
        self.pools: dict[str, list[Worker]] = {
            name: [self._make(url, name) for url in addrs[name]] for name in names
        }
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()  # set whenever a worker's health flips (readiness waits)
        self._on_load: list[Callable[[Worker], None]] = []  # after each GetLoad (metrics)
        self._on_remove: list[Callable[[Worker], None]] = []  # after a worker is dropped
        # The KV layout contract every PD worker must share (the first accepted one's).
        self.contract_hash = ""
        self._started = False
        self.version = 0  # moves when a worker joins, leaves or restarts: limits read again

    def _make(self, url: str, pool: str, source: str = "config") -> Worker:
        return open_worker(url, pool, self.config, source)

    def all(self) -> list[Worker]:
        return [w for ws in self.pools.values() for w in ws]

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.all() if w.url == url), None)

    def healthy(self, pool: str) -> list[Worker]:
        return [w for w in self.pools[pool] if w.healthy]

    def ready(self) -> bool:  # at least one healthy worker in every pool a request needs
        return all(any(w.healthy for w in ws) for ws in self.pools.values())

    def infos(self) -> list[tandem_pb2.WorkerInfo]:
        return [w.info for w in self.all() if w.info is not None]

    def on_load(self, callback: Callable[[Worker], None]) -> None:
        self._on_load.append(callback)

    def on_remove(self, callback: Callable[[Worker], None]) -> None:
        self._on_remove.append(callback)

    # ---- lifecycle ----

    async def start(self) -> None:
        self._started = True
        for w in self.all():
            self._watch_worker(w)

    def _watch_worker(self, w: Worker) -> None:
        w.tasks = [
            self.spawn(self._watch(w)),
            self.spawn(self._refresh_load(w)),
            self.spawn(self._follow_health(w)),
        ]

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until `ready()`; the readiness signal is a health flip, not a sleep."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.ready():
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            if not await wait_event(self._changed, left):
                return self.ready()
        return True

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.all()), return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a background coroutine owned by the pool (kept referenced until it ends). One
        that fails is a bug: logged with its traceback when it ends, not at garbage collection."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("gateway background task %s failed", task.get_coro(), exc_info=exc)

    # ---- membership ----

    async def add(self, url: str, role: str) -> tuple[Worker, bool]:
        """Admit a worker at run time once its GetInfo matches (POST /workers): (it, True);
        (its entry, False) when `url` is in that pool already: healthy (a join's renewal), or
        passing the identity check (a worker restarted on its address, which the entry's
        checks take back). Raises ValueError (bad role; `url` in another pool or going; the
        worker under another address), WorkerUnreachable or IdentityRefused."""
        pool = next((p for p in self.pools if ROLE_OF_POOL[p] == role), None)
        if pool is None:
            roles = ", ".join(ROLE_OF_POOL[p] for p in self.pools)
            raise ValueError(f"role {role!r} is not served here; this gateway's roles: {roles}")
        listed = self._check_listed(url, pool)
        if listed is not None and listed.healthy:  # its checks read its identity: no dial
            return listed, False
        w = self._make(url, pool, source="joined")  # a new channel: a listed one may back off
        try:
            info = await self._fetch_info(w)
            self._accept(w, info)
            if self._check_listed(url, pool) is not listed:  # the pools changed meanwhile
                raise ValueError(f"{url} was added or removed meanwhile; POST it again")
            twin = listed_elsewhere(url, info, self.all())
            if twin is not None:
                raise ValueError(
                    f"{url} is the worker already listed as {twin.url} (same epoch "
                    f"{info.epoch:016x}); the pools take each worker once"
                )
        except (WorkerUnreachable, IdentityRefused, ValueError):
            await w.channel.close()
            raise
        if listed is not None:
            await w.channel.close()
            log.debug("worker %s (%s) posted again: already in the pool", url, pool)
            return listed, False
        w.info, w.accepted, w.draining = info, True, info.draining
        self.pools[pool].append(w)
        self.version += 1
        log.info("worker %s (%s) added: %s", url, pool, w.expected.found_in(info).describe())
        if self._started:
            self._watch_worker(w)
        return w, True

    def _check_listed(self, url: str, pool: str) -> Worker | None:
        """`url`'s entry in `pool` if any; ValueError when it is in another pool or going."""
        w = self.find(url)
        if w is not None and w.pool != pool:
            raise ValueError(f"{url} is already in the {w.pool} pool (DELETE it first)")
        if w is not None and w.member is not Membership.ACTIVE:
            raise ValueError(f"{url} is being removed; POST it again once GET /workers drops it")
        return w

    def remove(self, w: Worker) -> None:
        """DELETE /workers/{url}: stop routing to `w` now, drain it, then drop it (idempotent)."""
        if w.member is not Membership.ACTIVE:
            return
        w.member = Membership.DRAINING
        self._set_health(w, False, quiet=True)  # the line below says it
        log.info("worker %s (%s): draining on request; %d requests in flight here",
                 w.url, w.pool, w.inflight)
        self.spawn(self._drain_and_drop(w))

    async def _drain_and_drop(self, w: Worker) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s + _REMOVE_GRACE_S
        ours = await self._still_ours(w, deadline)
        while ours:
            try:
                await w.stub.Drain(
                    tandem_pb2.DrainRequest(reason="DELETE /workers on the gateway"),
                    timeout=self.config.health_timeout_s,
                )
                break
            except grpc.aio.AioRpcError as exc:  # gone: nothing left to drain there
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and loop.time() < deadline:
                    continue  # stopped again: it is there, ask until it answers
                log.info("worker %s: Drain failed (%s); dropping it once idle here",
                         w.url, exc.code().name)
                break
        # A stranger (or nothing) at the address is never told to drain; wait only for our
        # own requests there.
        while loop.time() < deadline and (w.inflight or (ours and await self._answers(w))):
            await asyncio.sleep(_REMOVE_POLL_S)
        if w.inflight:
            log.warning(
                "worker %s: dropped with %d requests in flight after the drain timeout",
                w.url,
                w.inflight,
            )
        self._drop(w)

    async def _still_ours(self, w: Worker, deadline: float) -> bool:
        """Whether the process at w.url right now is the worker we accepted (a DELETE must
        never drain another cluster's worker that took the address). One that answers too
        late is still there (SIGSTOPped, a stuck loop): asked again until `deadline`, else a
        DELETE dropped it undrained and, woken, it served on outside every pool."""
        while True:
            try:
                self._accept(w, await self._fetch_info(w))
                return True
            except IdentityRefused:
                return False
            except WorkerUnreachable as exc:
                if exc.code is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    return False  # nothing listens there: nothing to drain
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning("worker %s did not answer within the drain timeout; dropped "
                                "without draining it (it may still run)", w.url)
                    return False

    async def _answers(self, w: Worker) -> bool:
        """Whether the worker process still answers (a drained worker exits)."""
        try:
            await w.stub.GetInfo(tandem_pb2.GetInfoRequest(), timeout=self.config.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        return True

    def _drop(self, w: Worker) -> None:
        w.member = Membership.REMOVED
        w.healthy = False
        for t in w.tasks:
            t.cancel()
        if w in self.pools[w.pool]:
            self.pools[w.pool].remove(w)
            self.version += 1
        if not any(o.info is not None for o in self.all()):  # its last holder left: a new
            self.contract_hash = ""  # fleet (another KV dtype, say) brings its own contract
        self.spawn(w.close())
        for cb in self._on_remove:
            cb(w)
        self._changed.set()
        log.info("worker %s (%s) removed", w.url, w.pool)

    # ---- identity ----

    async def _fetch_info(self, w: Worker) -> tandem_pb2.WorkerInfo:
        try:
            return await w.stub.GetInfo(
                tandem_pb2.GetInfoRequest(), timeout=self.config.health_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnreachable(
                f"cannot reach the worker at {w.url}: GetInfo failed with "
                f"{exc.code().name} ({exc.details()})",
                exc.code(),
            ) from None

    def _accept(self, w: Worker, info: tandem_pb2.WorkerInfo) -> None:
        """Check `info` against what `w` must be; IdentityRefused names the difference."""
        line = w.expected.mismatch(w.url, info)
        if not line and self.config.pd and info.contract_hash:
            others = {
                o.info.contract_hash
                for o in self.all()
                if o is not w and o.info is not None and o.info.contract_hash
            }
            have = self.contract_hash or next(iter(others), "")
            if have and info.contract_hash != have:
                line = (f"refusing the worker at {w.url}: expected KV contract {have[:16]}, found "
                        f"{info.contract_hash[:16]} (another model, KV dtype, page size, cache "
                        "groups, speculative section or transfer backend)")
        if line:
            raise IdentityRefused(line)
        if self.config.pd and info.contract_hash and not self.contract_hash:
            self.contract_hash = info.contract_hash

    def _forget_held(self, w: Worker) -> None:
        if w.forget_held():
            for cb in self._on_load:
                cb(w)

    async def _get_info(self, w: Worker) -> bool:
        """GetInfo and the identity check; False while unreachable or refused."""
        try:
            info = await self._fetch_info(w)
            self._accept(w, info)
        except WorkerUnreachable as exc:
            log.debug("%s", exc)
            w.draining = False  # a drained worker that exited is gone, not draining
            if exc.code is grpc.StatusCode.UNAVAILABLE:  # nothing there
                self._forget_held(w)
            return False
        except IdentityRefused as exc:
            if w.refusal != str(exc):
                log.error("%s", exc)
            w.refusal = str(exc)
            w.info = None
            self._set_health(w, False)
            self._forget_held(w)  # a stranger answers: what the entry showed held is gone
            return False
        if w.refusal:
            log.info("worker %s: the expected worker answers again", w.url)
            w.refusal = ""
        if w.pool == "prefill" and not info.bootstrap_addr and w.warned_epoch != info.epoch:
            w.warned_epoch = info.epoch  # once per process, not at every check
            log.error("prefill worker %s reports no bootstrap_addr; decode workers cannot "
                      "reach it", w.url)
        if w.info is not None and info.epoch != w.info.epoch:
            log.info("worker %s restarted (new epoch)", w.url)
        if w.info is None or info.epoch != w.info.epoch:
            self.version += 1
        w.info = info
        w.accepted = True
        w.draining = info.draining
        return True

    # ---- health ----

    def mark_suspect(self, w: Worker, why: str) -> None:
        """A request saw it gone (UNAVAILABLE), quiet past the stall deadline, or timed out by
        its room's other side (`why`, for the log line): out now; health checks bring it
        back."""
        if w.healthy:
            log.warning("worker %s (%s) marked unhealthy: %s; health checks take it back",
                        w.url, w.pool, why)
        w.fails = self.config.health_fail_threshold
        w.oks = 0
        self._set_health(w, False, quiet=True)

    def _set_health(self, w: Worker, healthy: bool, quiet: bool = False) -> None:
        """`quiet`: the caller logs the event (one line per event)."""
        if w.healthy != healthy:
            w.healthy = healthy
            w.served = w.served or healthy
            if not quiet:
                log.info("worker %s (%s) is now %s", w.url, w.pool,
                         "healthy" if healthy else "unhealthy")
            self._changed.set()

    def _record_check(self, w: Worker, ok: bool) -> None:
        cfg = self.config
        if ok:
            w.oks += 1
            w.fails = 0
            routable = w.info is not None and w.member is Membership.ACTIVE and not w.refusal
            if not w.healthy and routable and w.oks >= cfg.health_ok_threshold:
                self._set_health(w, True)
        else:
            w.fails += 1
            w.oks = 0
            if w.healthy and w.fails >= cfg.health_fail_threshold:
                self._set_health(w, False)

    async def _check(self, w: Worker) -> bool | None:
        """One round: GetInfo (identity, draining) then health. True: SERVING; False: the
        check failed (hysteresis applies); None: the worker itself says no (out at once)."""
        if not await self._get_info(w):
            return None if w.refusal else False
        if w.draining:
            return None
        try:
            resp = await w.health_stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.config.health_timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return True if resp.status == health_pb2.HealthCheckResponse.SERVING else None

    async def _watch(self, w: Worker) -> None:
        while w.member is not Membership.REMOVED:
            w.recheck.clear()  # a drop seen while this check runs asks for one more
            ok = await self._check(w)
            if ok is None:
                w.oks = 0
                self._set_health(w, False)
            else:
                self._record_check(w, ok)
            await wait_event(w.recheck, self.config.health_interval_s)

    async def _follow_health(self, w: Worker) -> None:
        """A health Watch stream: a worker that turns NOT_SERVING (it starts to drain) is
        taken out the moment it says so, not at the next check. Coming back is the checks'
        business (they re-check its identity first). The stream ends with its connection:
        whatever answers at the address next (a restarted worker, another cluster's) is
        routed to only once a check, run at once, has read who it is."""
        req = health_pb2.HealthCheckRequest(service="")
        while w.member is not Membership.REMOVED:
            try:
                async for reply in w.health_stub.Watch(req):
                    if reply.status != health_pb2.HealthCheckResponse.SERVING and w.healthy:
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                        log.info("worker %s (%s) says %s: unhealthy", w.url, w.pool, status)
                        w.oks = 0
                        self._set_health(w, False, quiet=True)
            except grpc.aio.AioRpcError as exc:  # unreachable or restarting: watch again soon
                log.debug("health watch on %s ended: %s", w.url, exc.code().name)
            if w.healthy:  # its checks keep their count: one good answer brings it back
                log.warning("worker %s (%s): connection lost; out until a check reads who "
                            "answers there", w.url, w.pool)
                self._set_health(w, False, quiet=True)
            w.recheck.set()
            await asyncio.sleep(self.config.health_interval_s)

    async def _refresh_load(self, w: Worker) -> None:
        interval = self.config.load_interval_s
        req = tandem_pb2.GetLoadRequest()
        while w.member is not Membership.REMOVED:
            if w.info is not None:  # first refresh as soon as the worker answered GetInfo
                try:
                    w.load = await w.stub.GetLoad(req, timeout=max(interval, 0.5))
                except grpc.aio.AioRpcError as exc:
                    log.debug("GetLoad on %s failed: %s", w.url, exc.code().name)
                else:
                    for cb in self._on_load:
                        cb(w)
            idle = self.config.health_interval_s / 2  # not accepted yet: check back soon
            await asyncio.sleep(interval if w.info is not None else idle)
