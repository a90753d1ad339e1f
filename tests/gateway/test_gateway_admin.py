"""The gateway's pools at run time: identity checks, POST/DELETE /workers, the admin key.

Scripted gRPC workers (tests/gateway/gw_doubles.py) that report an identity in GetInfo and
answer Drain; the gateway app runs in-process with its real pool and health tasks.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from protocol import tandem_pb2
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers

pytestmark = pytest.mark.anyio

CLUSTER, MODEL = "c1", "tiny:0123456789abcdef"
ADMIN = {"Authorization": "Bearer adm"}
BODY = {"prompt": "x", "max_tokens": 2}


class Member(ScriptedWorker):
    """A scripted worker with an identity (cluster id, model, KV contract) that drains."""

    def __init__(
        self,
        role: str = "both",
        cluster_id: str = CLUSTER,
        model_fp: str = MODEL,
        contract: str = "",
    ) -> None:
        super().__init__(role=role, script=Script(tokens=[70, 71], finish_reason="stop"))
        self.cluster_id, self.model_fp, self.contract = cluster_id, model_fp, contract
        self.draining = False
        self.drains: list[str] = []
        self.epoch = secrets.randbits(64) or 1  # new at every start, as a real worker's

    async def GetInfo(self, request, context):  # noqa: N802 (gRPC method names)
        info = await super().GetInfo(request, context)
        info.cluster_id, info.model_fingerprint = self.cluster_id, self.model_fp
        info.contract_hash, info.draining = self.contract, self.draining
        return info

    async def Drain(self, request, context):  # noqa: N802
        self.drains.append(request.reason)
        self.draining = True
        await self.set_serving(False)
        return tandem_pb2.DrainResponse()


def config(tok_dir, **kw):
    base = dict(
        cluster_id=CLUSTER,
        model_fingerprint=MODEL,
        admin_key="adm",
        api_key="api",
        prefill_policy="round_robin",
        health_ok_threshold=1,
    )
    return fast_config(tok_dir, **{**base, **kw})


async def listed(c, **kw) -> dict[str, dict]:
    resp = await c.get("/workers", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    return {w["url"]: w for w in resp.json()}


async def until(c, url: str, state: str, timeout: float = 5.0) -> dict:
    """Poll GET /workers until `url` is in `state` (or gone, for state 'gone')."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        ws = await listed(c)
        if (state == "gone" and url not in ws) or (url in ws and ws[url]["state"] == state):
            return ws.get(url, {})
        assert loop.time() < deadline, f"{url} not {state}: {ws.get(url)}"
        await asyncio.sleep(0.02)


def gen(c, **headers: str):
    return c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer api", **headers})


async def test_admin_routes_refuse_without_the_admin_key_and_with_the_api_key(tok_dir):
    w = Member()
    async with workers(w), running_app(config(tok_dir, workers=(w.url,))) as c:
        await until(c, w.url, "serving")
        routes = [
            ("GET", "/workers", None),
            ("POST", "/workers", {"url": "127.0.0.1:1", "role": "both"}),
            ("DELETE", f"/workers/{w.url}", None),
            ("GET", "/metrics", None),
        ]
        for method, path, body in routes:
            none = await c.request(method, path, json=body)
            assert none.status_code == 401, (method, path)
            assert none.json()["error"]["code"] == "missing_admin_key"
            for key in ("api", "wrong"):  # the API key is not the admin key
                r = await c.request(
                    method, path, json=body, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
                said = r.json()["error"]["message"]  # an API key is named as one, only then
                assert ("the API key is not the admin key" in said) == (key == "api"), said
        assert (await c.get("/metrics", headers=ADMIN)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # probes need no key
        assert (await gen(c)).status_code == 200  # the API key still serves requests
        assert w.drains == []  # no refused DELETE reached the worker


async def test_without_an_admin_key_the_pools_cannot_be_changed(tok_dir):
    w = Member()
    async with (
        workers(w),
        running_app(config(tok_dir, workers=(w.url,), admin_key="", api_key="")) as c,
    ):
        assert (await c.get("/workers")).status_code == 200  # no key anywhere: the dev default
        for method, path in (("POST", "/workers"), ("DELETE", f"/workers/{w.url}")):
            r = await c.request(method, path, json={"url": "127.0.0.1:1", "role": "both"})
            assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
    async with (
        workers(Member()) as (w2,),
        running_app(config(tok_dir, workers=(w2.url,), admin_key="")) as c,
    ):
        r = await c.get("/workers", headers={"Authorization": "Bearer api"})
        assert r.status_code == 403  # an API key is set: worker addresses are not for clients
        assert (await c.get("/metrics")).status_code == 403
    async with (
        workers(Member()) as (w3,),
        running_app(config(tok_dir, workers=(w3.url,), metrics_public=True)) as c,
    ):
        assert (await c.get("/metrics")).status_code == 200  # a scraper without a key


async def test_stale_worker_is_refused_at_start_and_on_reconnect(tok_dir, caplog):
    good, stale = Member(), Member(cluster_id="c-old")
    async with (
        workers(good, stale),
        running_app(config(tok_dir, workers=(good.url, stale.url))) as c,
    ):
        await until(c, good.url, "serving")
        ws = await until(c, stale.url, "refused")
        line = (
            f"refusing the worker at {stale.url}: expected cluster c1 role both model {MODEL}, "
            f"found cluster c-old role both model {MODEL} (a worker of another cluster or model "
            "answers there)"
        )
        assert ws["error"] == line and not ws["healthy"] and ws["cluster_id"] == ""
        assert line in caplog.text
        for _ in range(4):
            assert (await gen(c)).status_code == 200
        assert stale.requests == [] and len(good.requests) == 4  # never routed to the stranger
        # The good worker goes away and another model appears on its port: refused on reconnect.
        port = good.port
        await good.stop()
        other = await Member(model_fp="tiny:ffffffffffffffff").start(port=port)
        try:
            ws = await until(c, f"127.0.0.1:{port}", "refused")
            assert "found cluster c1 role both model tiny:ffffffffffffffff" in ws["error"]
            assert (await gen(c)).status_code == 503 and other.requests == []
            # The right worker comes back: accepted again.
            await other.stop()
            back = await Member().start(port=port)
            try:
                await until(c, back.url, "serving")
                assert (await gen(c)).status_code == 200 and len(back.requests) == 1
            finally:
                await back.stop()
        finally:
            await other.stop()


async def test_post_workers_adds_after_the_identity_check(tok_dir):
    a, b, stale = Member(), Member(), Member(cluster_id="c-old")
    async with workers(a, b, stale), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        assert r.json()["source"] == "joined" and r.json()["cluster_id"] == CLUSTER
        await until(c, b.url, "serving")
        for _ in range(4):
            assert (await gen(c)).status_code == 200
        assert len(a.requests) == 2 and len(b.requests) == 2  # round robin over both
        r = await c.post("/workers", json={"url": stale.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "identity_mismatch"
        assert r.json()["error"]["message"].startswith(
            f"refusing the worker at {stale.url}: expected cluster c1"
        )
        assert stale.url not in await listed(c)
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["url"] == b.url  # there already: a no-op
        assert list(await listed(c)) == [a.url, b.url]
        bad = [
            ({"url": "127.0.0.1:1", "role": "both"}, 502, "worker_unreachable"),
            ({"url": b.url}, 400, "invalid_value"),  # role missing
            ({"url": b.url, "role": "both", "weight": 2}, 400, "invalid_value"),  # not honoured
            ({"url": "http://127.0.0.1:5", "role": "both"}, 400, "invalid_value"),
            ({"url": "127.0.0.1:5", "role": "prefill"}, 409, "worker_conflict"),
        ]  # not a PD gateway
        for body, status, code in bad:
            r = await c.post("/workers", json=body, headers=ADMIN)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body, r.text)


async def test_one_worker_under_two_addresses_is_refused(tok_dir):
    # POST localhost:N for the worker listed as 127.0.0.1:N: its epoch says it is the same
    # process, so it is not listed twice (twice its seats; a DELETE of the second name would
    # drain the worker the first still routes to).
    a, b = Member(), Member()
    async with workers(a, b), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        alias = f"localhost:{a.port}"
        r = await c.post("/workers", json={"url": alias, "role": "both"}, headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "worker_conflict", r.text
        assert r.json()["error"]["message"] == (
            f"{alias} is the worker already listed as {a.url} (same epoch {a.epoch:016x}); "
            "the pools take each worker once"
        )
        assert list(await listed(c)) == [a.url]
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201, r.text  # another process is welcome
        await c.delete(f"/workers/{a.url}", headers=ADMIN)
        await a.stop()
        await until(c, a.url, "gone")
        a.epoch = secrets.randbits(64) or 1  # restarted: a new process, under either name
        a.draining = False
        await a.start(port=a.port)
        r = await c.post("/workers", json={"url": alias, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201, r.text


async def test_a_joined_worker_restarted_on_its_address_joins_again(tok_dir):
    # `tandem worker --join --port N` run again after a crash: its old entry (dead) is still
    # listed. Its POST must succeed (it was a 409, and the worker stopped itself, so a
    # supervisor restarting it looped with the pool short of a worker); the entry serves it.
    a, b = Member(), Member()
    async with workers(a, b), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        await until(c, b.url, "serving")
        await b.stop()  # crashed
        await until(c, b.url, "dead")
        b.epoch = secrets.randbits(64) or 1
        await b.start(port=b.port)
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["source"] == "joined"
        ws = await until(c, b.url, "serving")
        assert ws["epoch"] == f"{b.epoch:016x}"
        n_b = len(b.requests)
        for _ in range(4):
            assert (await gen(c)).status_code == 200
        assert len(b.requests) > n_b  # routed to again
        assert list(await listed(c)) == [a.url, b.url]  # one entry, not two


async def test_delete_drains_stops_routing_at_once_then_removes(tok_dir):
    a, b = Member(), Member()
    async with workers(a, b), running_app(config(tok_dir, workers=(a.url, b.url))) as c:
        await until(c, a.url, "serving")
        await until(c, b.url, "serving")
        r = await c.delete(f"/workers/{b.url}", headers=ADMIN)
        assert r.status_code == 202 and r.json()["state"] == "draining"
        n_b = len(b.requests)
        for _ in range(4):  # at once: not one request more reaches the draining worker
            assert (await gen(c)).status_code == 200
        assert len(b.requests) == n_b
        await until(c, b.url, "draining")
        assert b.drains == ["DELETE /workers on the gateway"]
        await b.stop()  # the drained worker exits
        await until(c, b.url, "gone")
        metrics = (await c.get("/metrics", headers=ADMIN)).text
        assert b.url not in metrics and a.url in metrics  # its series left with it
        r = await c.delete(f"/workers/{b.url}", headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"


async def test_pd_workers_must_share_one_kv_contract(tok_dir):
    p = Member(role="prefill", contract="a" * 64)
    d = Member(role="decode", contract="a" * 64)
    odd = Member(role="decode", contract="b" * 64)
    async with (
        workers(p, d, odd),
        running_app(config(tok_dir, prefill=(p.url,), decode=(d.url,))) as c,
    ):
        await until(c, d.url, "serving")
        r = await c.post("/workers", json={"url": odd.url, "role": "decode"}, headers=ADMIN)
        assert r.status_code == 409
        assert r.json()["error"]["message"] == (
            f"refusing the worker at {odd.url}: expected KV contract {'a' * 16}, found {'b' * 16} "
            "(another model, KV dtype, page size, cache groups, speculative section or transfer "
            "backend)"
        )


async def test_delete_never_drains_a_stranger_on_the_address(tok_dir):
    good, stale = Member(), Member(cluster_id="c-old")
    async with (
        workers(good, stale),
        running_app(config(tok_dir, workers=(good.url, stale.url))) as c,
    ):
        await until(c, good.url, "serving")
        await until(c, stale.url, "refused")
        r = await c.delete(f"/workers/{stale.url}", headers=ADMIN)
        assert r.status_code == 202
        await until(c, stale.url, "gone")
        assert stale.drains == [] and not stale.draining  # another cluster's worker is left alone
        assert (await gen(c)).status_code == 200


async def test_a_worker_that_starts_draining_is_taken_out_at_once(tok_dir):
    a, b = Member(), Member()
    # Checks every 5 s: only the health Watch stream can take b out well before the next one
    # (2 s leaves room for a loaded CI machine; the Watch takes milliseconds).
    async with (
        workers(a, b),
        running_app(config(tok_dir, workers=(a.url, b.url), health_interval_s=5.0)) as c,
    ):
        await until(c, a.url, "serving", timeout=15)
        await until(c, b.url, "serving", timeout=15)
        await asyncio.sleep(0.3)  # the Watch streams are open
        await b.set_serving(False)  # what SIGTERM does first on a real worker
        ws = await until(c, b.url, "dead", timeout=2.0)
        assert not ws["healthy"]
        n_b = len(b.requests)
        for _ in range(3):
            assert (await gen(c)).status_code == 200
        assert len(b.requests) == n_b


async def test_a_worker_that_drained_and_exited_shows_dead(tok_dir):
    a, b = Member(), Member()
    async with workers(a, b), running_app(config(tok_dir, workers=(a.url, b.url))) as c:
        await until(c, b.url, "serving")
        b.draining = True  # what a SIGTERM does: it says so in GetInfo ...
        await b.set_serving(False)
        await until(c, b.url, "draining")
        await b.stop()  # ... and exits once drained
        await until(c, b.url, "dead")


async def test_a_dead_worker_shows_nothing_held(tok_dir):
    # A worker killed mid-load (kill -9) holds nothing any more; its last GetLoad (running,
    # pages used) stayed in GET /workers and /metrics, so the pool's running count and a
    # page-leak alert saw requests and pages no process held. Its totals stay (counters).
    a, b = Member(), Member()
    b.load = tandem_pb2.Load(
        running=3, waiting=1, kv_used_pages=40, kv_total_pages=100, transfer_bytes=4096
    )
    async with workers(a, b), running_app(config(tok_dir, workers=(a.url, b.url))) as c:
        await until(c, b.url, "serving")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (await listed(c))[b.url]["kv_used_pages"] != 40:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        await b.stop()  # killed
        ws = await until(c, b.url, "dead")
        while ws["kv_used_pages"] or ws["running"]:
            assert loop.time() < deadline, ws
            await asyncio.sleep(0.02)
            ws = (await listed(c))[b.url]
        assert (ws["running"], ws["waiting"], ws["kv_used_pages"]) == (0, 0, 0)
        text = (await c.get("/metrics", headers=ADMIN)).text
        series = f'{{pool="workers",worker="{b.url}"}}'
        assert f"tandem_worker_kv_used_pages{series} 0.0" in text
        assert f"tandem_worker_running{series} 0.0" in text
        assert 'tandem_pool_running{pool="workers"} 0.0' in text
        assert f"tandem_worker_transfer_bytes_total{series} 4096.0" in text


async def test_each_change_of_a_worker_is_one_log_line(tok_dir, caplog):
    """DELETE is one line when it starts and one when the worker is dropped; a worker that
    says NOT_SERVING is one line. Each was two (the event's, then 'is now unhealthy')."""
    caplog.set_level("INFO", logger="gateway.pool")
    a, b, d = Member(), Member(), Member()
    async with (
        workers(a, b, d),
        running_app(config(tok_dir, workers=(a.url, b.url, d.url), health_interval_s=5.0)) as c,
    ):
        for w in (a, b, d):
            await until(c, w.url, "serving", timeout=15)
        await asyncio.sleep(0.3)  # the Watch streams are open
        caplog.clear()
        await b.set_serving(False)
        await until(c, b.url, "dead", timeout=2.0)
        assert (await c.delete(f"/workers/{d.url}", headers=ADMIN)).status_code == 202
        await until(c, d.url, "draining")
        await d.stop()
        await until(c, d.url, "gone")
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.pool"]
    about_b = [line for line in lines if b.url in line]
    about_d = [line for line in lines if d.url in line]
    assert len(about_b) == 1 and "NOT_SERVING" in about_b[0], lines
    assert len(about_d) == 2 and "draining" in about_d[0] and "removed" in about_d[1], lines


async def test_a_worker_just_added_is_starting_not_dead(tok_dir):
    """POST /workers answers with the new entry before its first health check: 'starting'
    (it said 'dead', healthy false, for a worker that had just passed the identity check);
    one that served and then failed is 'dead'."""
    a, b = Member(), Member()
    async with (
        workers(a, b),
        running_app(config(tok_dir, workers=(a.url,), health_ok_threshold=3,
                           health_interval_s=0.2)) as c,
    ):
        await until(c, a.url, "serving")
        r = await c.post("/workers", json={"url": b.url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 201 and r.json()["state"] == "starting", r.text
        assert (await listed(c))[b.url]["state"] == "starting"
        await until(c, b.url, "serving")
        await b.stop()
        await until(c, b.url, "dead")
