"""The pools changing while they serve, as an operator drives them: DELETE of a worker that
does not answer for a while (SIGSTOP, a stuck loop), and what the admin routes say.

Scripted gRPC workers (tests/gateway/gw_doubles.py, via test_gateway_admin's `Member`); the
gateway app runs in-process with its real pool and health tasks.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.gw_doubles import Script, running_app, workers
from tests.gateway.test_gateway_admin import ADMIN, Member, config, gen, listed, until

pytestmark = pytest.mark.anyio


class Hanging(Member):
    """A Member whose Worker service can stop answering (a SIGSTOPped process: calls are
    taken in and answered only once it runs again)."""

    def __init__(self) -> None:
        super().__init__()
        self.running = asyncio.Event()
        self.running.set()

    async def GetInfo(self, request, context):  # noqa: N802 (gRPC method names)
        await self.running.wait()
        return await super().GetInfo(request, context)

    async def Drain(self, request, context):  # noqa: N802
        await self.running.wait()
        return await super().Drain(request, context)


async def test_delete_of_a_hung_worker_drains_it_once_it_answers(tok_dir):
    # DELETE of a worker stopped for longer than one health timeout dropped it without ever
    # sending Drain (its GetInfo timed out: read as "not ours"); woken, it went on running,
    # out of every pool, never drained, its port and pages held.
    a, b = Member(), Hanging()
    async with (
        workers(a, b),
        running_app(config(tok_dir, workers=(a.url, b.url), health_timeout_s=0.2)) as c,
    ):
        await until(c, b.url, "serving")
        b.running.clear()  # SIGSTOP
        assert (await c.delete(f"/workers/{b.url}", headers=ADMIN)).status_code == 202
        await asyncio.sleep(1.0)  # stopped for five health timeouts
        assert (await gen(c)).status_code == 200  # routed around it
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        b.running.set()  # SIGCONT
        while not b.drains:
            assert loop.time() < deadline, (await listed(c)).get(b.url)
            await asyncio.sleep(0.02)
        assert b.drains == ["DELETE /workers on the gateway"]
        await until(c, b.url, "draining")
        await b.stop()  # the drained worker exits
        await until(c, b.url, "gone")


async def test_a_wrong_method_on_workers_names_every_method_it_takes(tok_dir):
    # PUT /workers answered 405 "use GET, HEAD" (Allow: GET, HEAD): POST, the route that adds
    # a worker, was left out, since GET and POST were two routes of one path.
    a = Member()
    async with workers(a), running_app(config(tok_dir, workers=(a.url,))) as c:
        for method in ("PUT", "PATCH", "DELETE"):
            r = await c.request(method, "/workers", headers=ADMIN)
            assert r.status_code == 405, r.text
            allow = {m.strip() for m in r.headers["allow"].split(",")}
            assert allow == {"GET", "HEAD", "POST"}, r.headers["allow"]
            assert "POST" in r.json()["error"]["message"]
        r = await c.request("PUT", f"/workers/{a.url}", headers=ADMIN)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE"
        assert (await c.get("/workers", headers=ADMIN)).status_code == 200
        r = await c.post("/workers", json={"url": a.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 200, r.text  # listed already: no change


async def test_limits_follow_the_workers_that_join_and_leave(tok_dir):
    # The limits (max_model_len: the minimum over the workers) were read once, when every
    # configured worker had answered, and never again: a worker that joined with a smaller
    # KV pool got prompts past its length (/v1/models said 32, the gateway let 40 tokens in).
    a, small = Member(), Member()
    small.max_model_len = 32
    body = {"prompt": "x", "max_tokens": 40}
    auth = {"Authorization": "Bearer api"}
    async with workers(a, small), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        assert (await c.post("/v1/completions", json=body, headers=auth)).status_code == 200
        r = await c.post("/workers", json={"url": small.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        await until(c, small.url, "serving")
        card = (await c.get("/v1/models", headers=auth)).json()["data"][0]
        assert card["max_model_len"] == 32
        r = await c.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 400 and "max_model_len (32)" in r.json()["error"]["message"]
        assert (await c.delete(f"/workers/{small.url}", headers=ADMIN)).status_code == 202
        await small.stop()
        await until(c, small.url, "gone")
        assert (await c.post("/v1/completions", json=body, headers=auth)).status_code == 200


@pytest.mark.slow  # the drop waits out drain_timeout_s + the pool's 5 s grace
async def test_a_worker_dropped_with_requests_on_it_leaves_metrics_for_good(tok_dir):
    # Dropped past its drain deadline with a request still on it, a worker's stream closes
    # and fails that request, whose fault was charged to the worker after its series had
    # left: tandem_worker_faults_total came back for a worker no longer listed, for good.
    a, b = Member(), Member()
    b.script = Script(hang_first=True)
    async with (
        workers(a, b),
        running_app(config(tok_dir, workers=(a.url, b.url), drain_timeout_s=0.1,
                           first_token_timeout_s=30.0)) as c,
    ):
        await until(c, a.url, "serving")
        await until(c, b.url, "serving")
        sent = [asyncio.ensure_future(gen(c)) for _ in range(2)]  # round robin: one on b
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not b.requests:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        assert (await c.delete(f"/workers/{b.url}", headers=ADMIN)).status_code == 202
        assert [r.status_code for r in await asyncio.gather(*sent)] == [200, 200]  # retried
        await until(c, b.url, "gone")
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert b.url not in metrics and a.url in metrics


async def test_a_new_fleet_may_bring_its_own_kv_contract_once_the_old_one_left(tok_dir):
    # The KV contract of the first worker accepted stayed the pools' for good: with every
    # worker of it deleted, a fleet with another KV dtype was refused ("expected KV contract
    # aaaa...", held by no worker) until the gateway restarted.
    p, d = Member(role="prefill", contract="a" * 64), Member(role="decode", contract="a" * 64)
    p8, d8 = Member(role="prefill", contract="b" * 64), Member(role="decode", contract="b" * 64)
    async with (
        workers(p, d, p8, d8),
        running_app(config(tok_dir, prefill=(p.url,), decode=(d.url,))) as c,
    ):
        await until(c, d.url, "serving")
        r = await c.post("/workers", json={"url": d8.url, "role": "decode"}, headers=ADMIN)
        assert r.status_code == 409  # never beside the other contract
        for old in (p, d):
            assert (await c.delete(f"/workers/{old.url}", headers=ADMIN)).status_code == 202
            await old.stop()
            await until(c, old.url, "gone")
        for new in (p8, d8):
            r = await c.post("/workers", json={"url": new.url, "role": new.role}, headers=ADMIN)
            assert r.status_code == 201, r.text
