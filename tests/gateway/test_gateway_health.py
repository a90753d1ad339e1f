"""Worker health: thresholds (state machine), NOT_SERVING → excluded → back, /health."""

from __future__ import annotations

import asyncio

import pytest

from gateway.pool import WorkerPool
from protocol import tandem_pb2
from tests.gateway.gw_doubles import (
    Script,
    ScriptedWorker,
    bounded,
    fast_config,
    running_app,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.anyio


async def test_thresholds_state_machine(tok_dir):
    pool = WorkerPool(
        fast_config(
            tok_dir, workers=("127.0.0.1:1",), health_fail_threshold=3, health_ok_threshold=2
        )
    )
    try:
        (w,) = pool.all()
        pool._record_check(w, True)
        assert not w.healthy  # no GetInfo yet: never healthy
        w.info = tandem_pb2.WorkerInfo(role="both")
        pool._record_check(w, True)
        assert w.healthy  # two good checks in a row (ok threshold 2)
        for expected in (True, True, False):  # the third consecutive failure takes it out
            pool._record_check(w, False)
            assert w.healthy is expected
        pool._record_check(w, True)
        pool._record_check(w, False)
        pool._record_check(w, True)
        assert not w.healthy  # good checks must be consecutive
        pool._record_check(w, True)
        assert w.healthy
        pool.mark_suspect(w, "a request saw UNAVAILABLE")
        assert not w.healthy
    finally:
        await pool.close()


async def test_not_serving_worker_is_excluded_then_returns(tok_dir):
    a = ScriptedWorker(script=Script(tokens=[70, 71], finish_reason="stop"))
    b = ScriptedWorker(script=Script(tokens=[70, 71], finish_reason="stop"))
    cfg = dict(health_fail_threshold=2, health_ok_threshold=2, prefill_policy="round_robin")
    async with workers(a, b), running_app(fast_config(tok_dir, workers=(a.url, b.url), **cfg)) as c:
        await wait_workers(c)
        await a.set_serving(False)
        ws = {}
        for _ in range(200):
            ws = {w["url"]: w["healthy"] for w in (await c.get("/workers")).json()}
            if not ws[a.url]:
                break
            await asyncio.sleep(0.02)
        assert ws == {a.url: False, b.url: True}
        n_a = len(a.requests)
        for _ in range(4):
            assert (
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            ).status_code == 200
        assert len(a.requests) == n_a and len(b.requests) >= 4  # excluded worker takes no requests
        assert (await c.get("/health")).status_code == 200  # one healthy worker is enough
        await b.set_serving(False)
        await wait_workers(c, healthy=False)
        assert (await c.get("/health")).status_code == 503
        await a.set_serving(True)
        for _ in range(200):
            if (await c.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert (await c.get("/health")).status_code == 200
        assert (
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        ).status_code == 200
        assert len(a.requests) == n_a + 1  # it takes requests again


async def test_worker_reachable_later(tok_dir):
    # The gateway starts before the worker: /health is 503, then 200 once GetInfo succeeds.
    w = ScriptedWorker(script=Script(tokens=[70], finish_reason="stop"))
    await w.start()
    port = w.port
    await w.stop()
    async with running_app(
        fast_config(tok_dir, workers=(f"127.0.0.1:{port}",), startup_wait_s=0)
    ) as c:
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503
        late = await ScriptedWorker(script=Script(tokens=[70], finish_reason="stop")).start(
            port=port
        )
        try:
            for _ in range(250):
                if (await c.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            assert (await c.get("/health")).status_code == 200
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        finally:
            await late.stop()


async def test_restarted_prefill_worker_gets_fresh_info(tok_dir):
    # A prefill worker restarts on the same port with a new epoch and bootstrap address: the
    # gateway takes it out while it is down and sends the new address once it is back.
    p = ScriptedWorker(role="prefill", script=Script(tokens=[70]))
    d = ScriptedWorker(role="decode", script=Script(tokens=[70, 71], finish_reason="stop"))
    async with (
        workers(p, d),
        running_app(fast_config(tok_dir, prefill=(p.url,), decode=(d.url,))) as c,
    ):
        assert (
            await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        ).status_code == 200
        await p.stop()
        for _ in range(200):
            if (await c.get("/health")).status_code == 503:
                break
            await asyncio.sleep(0.02)
        assert (await c.get("/health")).status_code == 503
        p2 = ScriptedWorker(role="prefill", script=Script(tokens=[70]))
        p2.bootstrap_addr, p2.epoch = "127.0.0.1:9", 2
        await p2.start(port=p.port)
        try:
            await wait_workers(c)
            assert (
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            ).status_code == 200
            assert d.requests[-1].disagg.bootstrap_addr == "127.0.0.1:9"
        finally:
            await p2.stop()


async def test_failed_background_task_is_logged_when_it_ends(tok_dir, caplog):
    pool = WorkerPool(fast_config(tok_dir, workers=("127.0.0.1:1",)))

    async def broken():
        raise RuntimeError("a bug in a background task")

    try:
        task = pool.spawn(broken())
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callbacks run
        failed = [r for r in caplog.records if "background task" in r.getMessage()]
        assert failed and failed[0].exc_info[1] is task.exception()
    finally:
        await pool.close()


async def test_a_prefill_worker_without_bootstrap_addr_is_logged_once(tok_dir, caplog):
    """The error line about a prefill worker that reports no bootstrap_addr is logged once,
    not at every health check (one ERROR a second, for as long as it ran, at the defaults)."""
    caplog.set_level("INFO", logger="gateway.pool")
    p = ScriptedWorker(role="prefill", script=Script(tokens=[5]))
    p._bootstrap = lambda: ""  # type: ignore[method-assign]
    d = ScriptedWorker(role="decode", script=Script(tokens=[5], finish_reason="stop"))
    async with workers(p, d):
        cfg = fast_config(tok_dir, prefill=(p.url,), decode=(d.url,))  # checks every 50 ms
        async with running_app(cfg) as c:
            await wait_workers(c)
            await asyncio.sleep(0.5)  # ten checks
    lines = [r.getMessage() for r in caplog.records if "bootstrap_addr" in r.getMessage()]
    assert len(lines) == 1, lines


async def test_a_hung_double_fails_its_test_named():
    """The doubles' steps are bounded: a hang fails in seconds, naming the step, instead of
    holding the shared event loop until pytest's timeout (then every later test failed)."""
    with pytest.raises(AssertionError, match="a step that hangs did not end within 0.1 s"):
        async with bounded("a step that hangs", seconds=0.1):
            await asyncio.Event().wait()


async def test_a_double_cannot_share_a_port_held_by_another():
    """A scripted worker restarted on its old port must fail when something else holds it, not
    share it through SO_REUSEPORT (grpc's default): the other holder (another test process's
    double) would answer half of the gateway's connections."""
    a = await ScriptedWorker(script=Script(tokens=[70])).start()
    try:
        with pytest.raises(RuntimeError):
            await ScriptedWorker(script=Script(tokens=[70])).start(port=a.port)
    finally:
        await a.stop()


async def test_the_pools_close_ends_a_watch_whose_recheck_fires_with_the_cancel(tok_dir):
    """Gateway shutdown while a worker's connection drops: the drop sets the worker's recheck
    event in the turn the close cancels its health watch. Python 3.11's asyncio.wait_for then
    returned the event's result and swallowed the cancel, the watch looped on and the close
    waited for it forever (tests/gateway hung in `the gateway's stop`, make test and CI)."""
    pool = WorkerPool(fast_config(tok_dir, workers=("127.0.0.1:1",), health_interval_s=30.0,
                                  startup_wait_s=0))
    await pool.start()
    await asyncio.sleep(0.3)  # the first check failed: the watch waits for the next
    (w,) = pool.all()
    w.recheck.set()
    async with bounded("the pool's close", seconds=5.0):
        await pool.close()
