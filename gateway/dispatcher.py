"""The gateway's dispatcher: what every request's run (gateway/dispatch.py `RequestRun`) shares.

The worker pool and its routing policies (`pick`), the decode seats (`take_seat`: the gateway's
queue while every healthy decode worker is full, gateway/admission.py; `left` frees one), the
stall watch (gateway/stalls.py), the faults charged per worker (`blame`), and the PD rooms'
counter (`new_room`).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence

from gateway.admission import AdmissionQueue, has_seat
from gateway.config import GatewayConfig
from gateway.errors import NoHealthyWorker, WorkerCallError
from gateway.metrics import Metrics
from gateway.pool import Worker, WorkerPool
from gateway.routing import CacheAware, LeastLoad, Policy, least_loaded
from gateway.stalls import StallWatch
from protocol import bootstrap_addr


class Dispatcher:
    """What every request's `RequestRun` shares: the pool, its policies, the decode seats,
    the stall watch, the metrics, and the PD rooms' counter."""

    def __init__(self, config: GatewayConfig, pool: WorkerPool, policies: dict[str, Policy],
                 metrics: Metrics) -> None:
        self.config = config
        self.pool = pool
        self.policies = policies
        self.metrics = metrics
        # Decode seats are held here (backpressure); prefill and mono queue inside the workers.
        self.admission = AdmissionQueue("decode", config.max_queued_requests,
                                        config.queue_timeout_s, metrics)
        self.stalls = StallWatch(config.stream_stall_timeout_s, pool)
        # PD rooms: one up a request from a random 64-bit start (no getrandom call a request);
        # two gateways' rooms meet only if their starts lie within each other's request counts.
        self._rooms = itertools.count(secrets.randbits(64))

    def new_room(self, prefill: Worker, prompt_ids: Sequence[int]) -> int:
        """A room id for a PD attempt on `prefill`; never 0, which means "no room" on the wire.

        A prefill worker with attention DP lists its groups' bootstrap addresses
        (protocol/bootstrap_addr.py) and runs room r in group r % groups (decode registers
        there too), each group with its own prefix cache: the room is drawn in the group the
        cache-aware policy remembers for the prompt's prefix on that worker while that group is
        within the load bound, else in the least-loaded group (equal loads: the groups in
        turn); least_load takes the least-loaded group, round_robin the groups in turn."""
        draw = next(self._rooms)
        groups = self.dp_groups(prefill)
        if groups == 1:
            return bootstrap_addr.room_in_group(draw, 0, 1)
        policy, fresh = self.policies["prefill"], draw % groups
        if isinstance(policy, CacheAware):
            group = policy.group(prefill.url, prompt_ids, prefill.group_loads(groups), fresh)
        elif isinstance(policy, LeastLoad):
            group = least_loaded(prefill.group_loads(groups), fresh)
        else:
            group = fresh
        return bootstrap_addr.room_in_group(draw, group, groups)

    @staticmethod
    def dp_groups(prefill: Worker) -> int:
        """The attention-DP groups of a prefill worker (1 without DP)."""
        return bootstrap_addr.num_groups(prefill.info.bootstrap_addr) if prefill.info else 1

    def _healthy(self, pool: str, exclude: set[str]) -> list[Worker]:
        cands = [w for w in self.pool.pools[pool] if w.healthy and w.url not in exclude]
        if not cands:
            which = "" if pool == "workers" else f"{pool} "
            raise NoHealthyWorker(f"no healthy {which}worker is available; retry later",
                                  code="no_healthy_worker", retry_after_s=1)
        return cands

    def check_pairs(self, exclude: set[str]) -> None:
        """NoHealthyWorker unless every pool has a healthy worker outside `exclude` (a retry
        has somewhere to go)."""
        for pool in self.pool.pools:
            self._healthy(pool, exclude)

    def pick(self, pool: str, prompt_ids: Sequence[int], exclude: set[str],
             prefer: Worker | None = None) -> Worker:
        """The policy's pick, or `prefer` while it is healthy and not excluded (a choice of an
        n > 1 request goes where the prompt's pages are cached: gateway/choices.py)."""
        cands = self._healthy(pool, exclude)
        if prefer is not None and any(w is prefer for w in cands):
            return prefer
        return self.policies[pool].pick(cands, prompt_ids)

    async def take_seat(self, prompt_ids: Sequence[int], exclude: set[str]) -> Worker:
        """A decode worker with a free seat; waits in the gateway's queue while all are full."""
        def pick() -> Worker | None:
            free = [w for w in self._healthy("decode", exclude) if has_seat(w)]
            return self.policies["decode"].pick(free, prompt_ids) if free else None
        return await self.admission.acquire(pick)

    def left(self, w: Worker, group: int = -1) -> None:
        """A leg left `w` (ended there, or cancelled; in DP group `group` of a prefill worker):
        its seat is free even while its outputs wait unread (n > 1: finished choices wait for
        the others' first tokens)."""
        w.inflight -= 1
        if group >= 0:
            w.group_inflight[group] -= 1
        if w.pool == "decode":
            self.admission.wake()

    def blame(self, err: WorkerCallError) -> None:
        """Charge a failed attempt to the worker it blames (/metrics); not to one dropped
        from the pools (its stream's close failed the attempt): its series left with it."""
        if self.pool.find(err.blamed_url) is None:
            return
        self.metrics.worker_faults.labels(err.blamed_pool, err.blamed_url).inc()
