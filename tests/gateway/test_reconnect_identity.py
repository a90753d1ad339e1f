"""A worker's connection drops: it is out until a check has read who answers at its address.

Between two health checks the gateway routed on the identity it had read last. A worker
whose process ended, and whose port another cluster's worker took before the next check
(`health_interval_s`, 1 s by default), stayed `serving`: the next request went to the
stranger, which answered it.
"""

from __future__ import annotations

import asyncio

import pytest

from protocol import tandem_pb2
from tests.gateway.gw_doubles import running_app, workers
from tests.gateway.test_gateway_admin import ADMIN, Member, config, gen, listed, until

pytestmark = pytest.mark.anyio

CHECKS_S = 60.0  # no periodic check runs during the test


async def until_left(c, url: str, state: str, timeout: float) -> dict:
    """`url`'s entry once it has left `state`; fails after `timeout` (well under CHECKS_S:
    only the dropped connection, not a periodic check, can have moved it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (ws := await listed(c))[url]["state"] == state:
        assert loop.time() < deadline, f"{url} still {state}: {ws[url]}"
        await asyncio.sleep(0.02)
    return ws[url]


async def test_a_stranger_taking_the_address_before_the_next_check_gets_nothing(tok_dir):
    good = Member()
    async with workers(good), running_app(
        config(tok_dir, workers=(good.url,), health_interval_s=CHECKS_S)
    ) as c:
        await until(c, good.url, "serving")
        assert (await gen(c)).status_code == 200
        port = good.port
        await good.stop()
        stranger = await Member(cluster_id="c-other").start(port=port)
        try:
            await until_left(c, good.url, "serving", timeout=10.0)
            r = await gen(c)
            assert r.status_code == 503 and stranger.requests == [], r.text
        finally:
            await stranger.stop()


async def test_the_same_worker_back_on_its_address_is_checked_before_it_serves(tok_dir, caplog):
    # The worker restarted (a new process of this cluster): it was taken out when its
    # connection dropped, and serves again once a check has read its new epoch. (It served on
    # under the old process's identity until the next periodic check.)
    caplog.set_level("INFO", logger="gateway.pool")
    good = Member()
    async with workers(good), running_app(
        config(tok_dir, workers=(good.url,), health_interval_s=2.0)
    ) as c:
        await until(c, good.url, "serving")
        port = good.port
        await good.stop()
        back = await Member().start(port=port)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10.0
            while (ws := (await listed(c))[good.url])["epoch"] != f"{back.epoch:016x}":
                assert loop.time() < deadline, f"the new process is not checked: {ws}"
                await asyncio.sleep(0.02)
            await until(c, good.url, "serving", timeout=10.0)
            # a worker that vanishes without saying NOT_SERVING first (killed, crashed) is an
            # operator's concern: WARNING (a drained one says so, and its loss is quiet)
            assert any(r.levelname == "WARNING" and f"worker {good.url} (workers): connection "
                       "lost" in r.getMessage() for r in caplog.records), caplog.text
            assert (await gen(c)).status_code == 200 and len(back.requests) == 1
        finally:
            await back.stop()


async def test_a_refused_entry_shows_nothing_held(tok_dir):
    # What answers at the address is not the worker whose load the entry showed (here the
    # double changes its identity in place, standing for another process on the port): the
    # running requests and pages of the last GetLoad were that worker's, and it is gone.
    # They stayed in GET /workers and in /metrics (and in the pool's sums) as long as the
    # stranger answered.
    good = Member()
    good.load = tandem_pb2.Load(running=3, waiting=1, kv_used_pages=40, kv_total_pages=100)
    async with workers(good), running_app(config(tok_dir, workers=(good.url,))) as c:
        ws = await until(c, good.url, "serving")
        while ws["kv_used_pages"] != 40:  # the first GetLoad lands
            await asyncio.sleep(0.02)
            ws = (await listed(c))[good.url]
        good.cluster_id = "c-other"
        ws = await until(c, good.url, "refused")
        assert (ws["running"], ws["waiting"], ws["kv_used_pages"]) == (0, 0, 0), ws
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert f'tandem_worker_kv_used_pages{{pool="workers",worker="{good.url}"}} 0.0' in metrics
        assert 'tandem_pool_running{pool="workers"} 0.0' in metrics
