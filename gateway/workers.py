"""One worker as the gateway sees it: its channel, identity, health, load and membership.

The records and states the pool (gateway/pool.py) keeps per worker, and the JSON that
GET /workers shows. Mutated only by the pool's tasks and by dispatch (`inflight`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.session import WorkerSession
from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.identity import WorkerIdentity
from protocol.tls import aio_channel

ROLE_OF_POOL = {"workers": "both", "prefill": "prefill", "decode": "decode"}

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect quickly after a worker restarts; the health checks notice it within one interval.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Its own connection: POST /workers dials a listed url anew, past that entry's backoff.
    ("grpc.use_local_subchannel_pool", 1),
]


class Membership(enum.Enum):
    """A worker's place in the pools (the operator's doing, not its health)."""

    ACTIVE = "active"
    DRAINING = "draining"  # DELETE /workers: no new requests; dropped once drained
    REMOVED = "removed"


class WorkerState(enum.Enum):
    """What GET /workers shows."""

    STARTING = "starting"  # configured or added, GetInfo not answered yet
    SERVING = "serving"  # identity accepted, healthy: takes requests
    DRAINING = "draining"  # told to drain (SIGTERM or DELETE): finishes what it holds
    REFUSED = "refused"  # something else answers at its address (another cluster or model)
    DEAD = "dead"  # unreachable or failing its health checks
    REMOVED = "removed"


class IdentityRefused(Exception):
    """A worker's GetInfo does not match what this gateway expects; the message is the line."""


class WorkerUnreachable(Exception):
    """A worker did not answer GetInfo; the message names it and the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code  # UNAVAILABLE: nothing listens at its address (the process is gone)


@dataclass(eq=False)
class Worker:
    """One worker as the gateway sees it. Mutated only by the pool's tasks and dispatch."""

    url: str  # host:port
    pool: str  # the pool it serves in: workers | prefill | decode
    channel: grpc.aio.Channel
    stub: tandem_pb2_grpc.WorkerStub
    health_stub: health_pb2_grpc.HealthStub
    session: WorkerSession  # the one stream every request to this worker rides
    expected: WorkerIdentity = field(default_factory=WorkerIdentity)
    source: str = "config"  # config (the gateway's configuration) | joined (POST /workers)
    info: tandem_pb2.WorkerInfo | None = None  # the accepted GetInfo; None until then
    refusal: str = ""  # the one-line reason while its address answers as someone else
    healthy: bool = False  # routable: accepted, active and passing its health checks
    draining: bool = False  # the worker says it is draining (GetInfo / NOT_SERVING)
    accepted: bool = False  # its identity has been accepted at least once
    served: bool = False  # it has been healthy at least once (else still starting)
    warned_epoch: int = -1  # the epoch whose missing bootstrap_addr was logged (prefill)
    member: Membership = Membership.ACTIVE
    fails: int = 0  # consecutive failed health checks
    oks: int = 0  # consecutive SERVING answers
    load: tandem_pb2.Load = field(default_factory=tandem_pb2.Load)
    inflight: int = 0  # requests this gateway has on the worker right now
    group_inflight: dict[int, int] = field(default_factory=dict)  # of those, per DP group
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)  # its watch and load tasks
    # Set when its connection dropped: check who answers now, not at the next interval.
    recheck: asyncio.Event = field(default_factory=asyncio.Event)

    def load_score(self) -> float:
        """Load for routing: the worker's queue, plus our own in-flight requests (GetLoad lags
        by up to one refresh, so a burst would otherwise all go to one worker), plus KV use."""
        return _score(self.load, self.inflight)

    def group_loads(self, groups: int) -> list[float]:
        """Load per attention-DP group (a prefill worker runs room r in group r % groups):
        each group's reported queue and KV use, when the worker reports one per group, plus this
        gateway's requests in flight there."""
        reported = self.load.dp_groups
        if len(reported) != groups:  # no report per group (yet): ours alone
            return [float(self.group_inflight.get(g, 0)) for g in range(groups)]
        return [_score(gl, self.group_inflight.get(g, 0)) for g, gl in enumerate(reported)]

    async def close(self) -> None:
        """End its stream (the worker aborts what it still carried), then its channel."""
        await self.session.close()
        await self.channel.close()

    def forget_held(self) -> bool:
        """Its process is gone, and with it what it held: running and waiting requests, pages,
        rooms (its totals since start stay: counters). True when that changed the load."""
        ld = self.load
        held = ("running", "waiting", "kv_used_pages", "kv_cached_pages", "kv_window_used_pages")
        changed = any(getattr(ld, f) for f in held) or len(ld.rooms) > 0
        for f in held:
            setattr(ld, f, 0)
        ld.rooms.clear()
        del ld.dp_groups[:]
        return changed

    @property
    def state(self) -> WorkerState:
        if self.member is Membership.REMOVED:
            return WorkerState.REMOVED
        if self.member is Membership.DRAINING or self.draining:
            return WorkerState.DRAINING
        if self.refusal:
            return WorkerState.REFUSED
        if self.healthy:
            return WorkerState.SERVING
        # Accepted but not yet through its health checks (a POST /workers answer): starting,
        # unless a check failed since.
        dead = self.served or (self.accepted and self.fails > 0)
        return WorkerState.DEAD if dead else WorkerState.STARTING

    def as_json(self) -> dict[str, Any]:
        ld, info = self.load, self.info
        groups = [{"running": g.running, "waiting": g.waiting, "kv_used_pages": g.kv_used_pages,
                   "kv_total_pages": g.kv_total_pages, "inflight": self.group_inflight.get(i, 0),
                   "prompt_tokens_computed": g.prompt_tokens_computed}
                  for i, g in enumerate(ld.dp_groups)]
        return {
            "url": self.url,
            "role": info.role if info else ROLE_OF_POOL[self.pool],
            "pool": self.pool,
            "healthy": self.healthy,
            "state": self.state.value,
            "source": self.source,
            "running": ld.running,
            "waiting": ld.waiting,
            "kv_used_pages": ld.kv_used_pages,
            "kv_total_pages": ld.kv_total_pages,
            "kv_cached_pages": ld.kv_cached_pages,
            "inflight": self.inflight,
            "cluster_id": info.cluster_id if info else "",
            "replica": info.replica if info else -1,
            "model_fingerprint": info.model_fingerprint if info else "",
            "contract_hash": info.contract_hash if info else "",
            "epoch": f"{info.epoch:016x}" if info else "",
            "error": self.refusal,
            **({"dp_groups": groups} if groups else {}),  # attention DP: each group's share
        }


def _score(ld: tandem_pb2.Load | tandem_pb2.GroupLoad, inflight: int) -> float:
    """A worker's (or a DP group's) load for routing: running + waiting + our in flight + KV
    fraction."""
    kv = ld.kv_used_pages / ld.kv_total_pages if ld.kv_total_pages else 0.0
    return ld.running + ld.waiting + inflight + kv


def open_worker(url: str, pool: str, config: GatewayConfig, source: str = "config") -> Worker:
    """A worker entry with its own channel (nothing dialed yet) and the identity it must show."""
    ch = aio_channel(url, config.tls, options=CHANNEL_OPTIONS)
    stub = tandem_pb2_grpc.WorkerStub(ch)
    # Replicas are not checked here: a Kubernetes pool's pods all run one command line.
    expected = WorkerIdentity(
        cluster_id=config.cluster_id,
        role=ROLE_OF_POOL[pool],
        model_fingerprint=config.model_fingerprint,
    )
    return Worker(
        url=url,
        pool=pool,
        channel=ch,
        stub=stub,
        health_stub=health_pb2_grpc.HealthStub(ch),
        session=WorkerSession(stub, url),
        expected=expected,
        source=source,
    )


def listed_elsewhere(
    url: str, info: tandem_pb2.WorkerInfo, listed: Iterable[Worker]
) -> Worker | None:
    """The entry, under another address, of the process answering at `url` (the same epoch):
    listed twice (127.0.0.1:N and localhost:N) a worker would get twice its seats, and a
    DELETE of either name would drain it under the other."""
    same = (o for o in listed if o.url != url and o.info is not None and o.info.epoch == info.epoch)
    return next(same, None) if info.epoch else None
