"""PD dispatch against scripted prefill and decode workers: room, legs, retry, aborts."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest

from protocol import tandem_pb2
from tests.gateway.gw_doubles import (
    Script,
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.anyio

TOKENS = [70, 71, 72, 73, 74]


def prefill(**kw) -> ScriptedWorker:
    # As a prefill worker does: its last message, when the room ends, carries the transfer stats.
    kw.setdefault("transfer", tandem_pb2.TransferStats(pages=3, bytes=12288, duration_ms=2.5))
    return ScriptedWorker(role="prefill", script=Script(tokens=TOKENS[:1], cached_tokens=4, **kw))


def decode(**kw) -> ScriptedWorker:
    return ScriptedWorker(role="decode", script=Script(tokens=TOKENS, finish_reason="stop", **kw))


def pd_config(tok_dir, ps, ds, **kw):
    kw.setdefault("decode_policy", "round_robin")
    kw.setdefault("prefill_policy", "round_robin")
    return fast_config(
        tok_dir, prefill=tuple(p.url for p in ps), decode=tuple(d.url for d in ds), **kw
    )


async def test_pd_both_legs_share_room(tok_dir):
    p, d = prefill(), decode()
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        r = await c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5},
                         headers={"X-Request-Id": "pd-1"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 4  # from the prefill leg
        assert body["usage"]["completion_tokens"] == len(TOKENS)
        (rp,), (rd,) = p.requests, d.requests
        assert rp.disagg.room == rd.disagg.room != 0
        assert rp.disagg.bootstrap_addr == rd.disagg.bootstrap_addr == f"127.0.0.1:{p.port + 1}"
        assert rp.request_id == rd.request_id and rp.request_id.startswith("pd-1-")
        assert list(rp.prompt_token_ids) == list(rd.prompt_token_ids)
        assert p.aborts == [] and d.aborts == []  # a finished request is not aborted
        m = (await c.get("/metrics")).text
        assert (
            "tandem_kv_transfer_bytes_total 12288.0" in m and "tandem_cached_tokens_total 4.0" in m
        )
        assert "tandem_kv_transfer_duration_seconds_count 1.0" in m
        ws = (await c.get("/workers")).json()
        assert sorted(w["role"] for w in ws) == ["decode", "prefill"]
        assert all(w["inflight"] == 0 for w in ws)


async def test_retry_once_on_new_decode_before_first_token(tok_dir):
    p = prefill()
    bad, good = decode(fail_code=grpc.StatusCode.UNAVAILABLE), decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
        assert r.status_code == 200
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
        assert len(bad.requests) == 1 and len(good.requests) == 1 and len(p.requests) == 2
        first_room, second_room = (q.disagg.room for q in p.requests)
        assert first_room != second_room and good.requests[0].disagg.room == second_room
        await p.abort_event.wait()
        await bad.abort_event.wait()
        assert p.aborts[0].room == first_room and bad.aborts[0].room == first_room
        m = (await c.get("/metrics")).text
        assert "tandem_retries_total 1.0" in m and "tandem_kv_transfer_failures_total 1.0" in m
        ws = {w["url"]: w for w in (await c.get("/workers")).json()}
        assert ws[bad.url]["healthy"] is False  # UNAVAILABLE: suspect at once


async def test_retry_on_new_prefill_when_prefill_fails(tok_dir):
    bad, good, d = prefill(fail_code=grpc.StatusCode.INTERNAL), prefill(), decode()
    d.script.first_delay_s = 0.3  # decode's first token comes after prefill (which fails at once)
    async with workers(bad, good, d), running_app(pd_config(tok_dir, [bad, good], [d])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert len(bad.requests) == 1 and len(good.requests) == 1 and len(d.requests) == 2
        # INTERNAL is the worker's fault but not a sign it is down: it stays healthy
        ws = {w["url"]: w for w in (await c.get("/workers")).json()}
        assert ws[bad.url]["healthy"] is True


async def test_client_error_is_not_retried(tok_dir):
    p = prefill()
    bad, good = decode(fail_code=grpc.StatusCode.INVALID_ARGUMENT), decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument"
        # The client's mistake in the worker's words, not our topology (which worker, which leg).
        assert r.json()["error"]["message"] == "scripted INVALID_ARGUMENT", r.json()
        assert len(bad.requests) == 1 and good.requests == []
        assert all(w["healthy"] for w in (await c.get("/workers")).json())


async def test_no_retry_after_first_token(tok_dir):
    p = prefill()
    bad, good = decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_after=2), decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unavailable"
        assert json.loads(events[0])["choices"][0]["text"]  # the first tokens did reach the client
        assert len(bad.requests) == 1 and good.requests == [] and len(p.requests) == 1


async def test_a_non_streamed_answer_runs_again_when_decode_fails_past_its_first_token(tok_dir):
    """The client has seen nothing of a JSON answer yet: a worker's fault after the first
    token runs the request again from its prompt on a new pair (the one retry), as a fault
    before it would; the answer is the new attempt's whole output, counted once."""
    p = prefill()
    bad, good = decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_after=2), decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                         headers={"X-Request-Id": "rq"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["completion_tokens"] == len(TOKENS)
        rid = p.requests[0].request_id  # the client's X-Request-Id leads it, unique
        assert rid.startswith("rq-")
        assert [q.attempt_id for q in (*bad.requests, *good.requests)] == [f"{rid}/0", f"{rid}/1"]
        assert len(p.requests) == 2 and p.requests[0].disagg.room != p.requests[1].disagg.room
        await bad.abort_event.wait()
        assert [a.attempt_id for a in bad.aborts] == [f"{rid}/0"]
        m = (await c.get("/metrics")).text
        assert "tandem_retries_total 1.0" in m and "tandem_generation_tokens_total 5.0" in m
        # The same answer as a clean run's (the good pair alone).
        again = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]


async def test_a_non_streamed_answer_runs_again_once_only(tok_dir):
    """The one retry was spent before the first token (or is off): a later fault is the
    answer's 5xx."""
    p = prefill()
    flaky = decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_times=2)
    flaky.script.fail_after = 0  # the first attempt fails at once, the retry after 2 tokens
    other = decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_after=2)
    async with workers(p, flaky, other), running_app(pd_config(tok_dir, [p], [flaky, other])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code in (502, 503), r.text
        assert len(flaky.requests) + len(other.requests) == 2
    p, bad, good = prefill(), decode(fail_code=grpc.StatusCode.UNAVAILABLE, fail_after=2), decode()
    config = pd_config(tok_dir, [p], [bad, good], retry_before_first_token=False)
    async with workers(p, bad, good), running_app(config) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code in (502, 503) and good.requests == [], r.text


async def test_first_token_timeout_without_alternative(tok_dir):
    p, d = prefill(), decode(hang_first=True)
    async with (
        workers(p, d),
        running_app(pd_config(tok_dir, [p], [d], first_token_timeout_s=0.3)) as c,
    ):
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        await d.abort_event.wait()
        assert d.aborts[0].room == d.requests[0].disagg.room != 0


async def test_stop_string_aborts_both_legs(tok_dir):
    p, d = prefill(), decode(delay_s=0.01)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 5, "stream": True, "stop": "\x00"},
        )
        assert r.status_code == 200  # stop never matches: no abort for a finished request
        assert d.aborts == [] and p.aborts == []
        text = r.text
        some = json.loads(text.split("\n\n")[1][len("data: "):])["choices"][0]["text"]
        assert some
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stop": some})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        await p.abort_event.wait()
        await d.abort_event.wait()
        room = d.requests[1].disagg.room
        assert p.aborts[0].room == d.aborts[0].room == room != 0


async def test_a_stop_string_still_counts_the_rooms_transfer(tok_dir):
    """The prefill leg's last message (the stats) comes after decode's first tokens; a request
    that a stop string ends is still counted: the gateway lets that leg finish."""
    p, d = prefill(delay_s=0.3), decode(delay_s=0.01)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        stream = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                       "stream": True})
        first = json.loads(stream.text.split("\n\n")[0][len("data: "):])["choices"][0]["text"]
        for _ in range(2):  # the second request waits for the first one's stats too
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                      "stop": first[:1]})
            assert r.json()["choices"][0]["finish_reason"] == "stop"
        await d.abort_event.wait()
        for _ in range(100):
            m = (await c.get("/metrics")).text
            if "tandem_kv_transfer_duration_seconds_count 3.0" in m:
                break
            await asyncio.sleep(0.05)
        assert "tandem_kv_transfer_duration_seconds_count 3.0" in m
        assert "tandem_kv_transfer_bytes_total 36864.0" in m  # 3 requests x 12288


async def test_drain_cuts_a_prefill_leg_that_does_not_end():
    # After the answer, a prefill leg gets a bounded time to deliver its last message; one that
    # ends in time stops the timer, one that does not is cut off (and its call cancelled).
    from gateway.dispatch import _drain

    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    quick, stuck = asyncio.create_task(asyncio.sleep(0.01)), asyncio.create_task(asyncio.sleep(10))
    quick_call, stuck_call = Call(), Call()
    _drain(quick, quick_call, timeout_s=0.1)
    _drain(stuck, stuck_call, timeout_s=0.1)
    await asyncio.sleep(0.3)
    assert quick.done() and not quick.cancelled() and not quick_call.cancelled
    assert stuck.cancelled() and stuck_call.cancelled


def test_rooms_count_up_from_a_random_start_and_skip_zero() -> None:
    """0 means "no room" on the wire: the count wraps past 2**64 - 1 to 1."""
    import itertools

    from gateway.dispatcher import Dispatcher

    d = Dispatcher.__new__(Dispatcher)  # only the room counter
    d._rooms = itertools.count((1 << 64) - 2)
    p = SimpleNamespace(url="p", info=SimpleNamespace(bootstrap_addr="h:1"))
    assert [d.new_room(p, []) for _ in range(3)] == [(1 << 64) - 2, (1 << 64) - 1, 1]


def test_a_session_stays_in_its_prefill_dp_group() -> None:
    """A prefill worker with attention DP runs room r in group r % groups ('g0;g1' bootstrap
    addresses), each with its own prefix cache. Drawn from the counter alone, a session's turns
    alternated groups and missed the cache every other turn; now each turn's room is drawn in
    the group that ran its prefix, and new sessions still take the groups in turn."""
    import itertools

    from gateway.dispatcher import Dispatcher
    from gateway.routing import CacheAware

    d = Dispatcher.__new__(Dispatcher)  # the room counter and the prefill policy
    d._rooms = itertools.count(10)
    d.policies = {"prefill": CacheAware(page_size=2)}
    p = SimpleNamespace(url="p", info=SimpleNamespace(bootstrap_addr="h:1;h:2"),
                        load_score=lambda: 0.0, group_loads=lambda n: [0.0] * n)
    session = [7, 7, 7, 7]
    groups = []
    for turn in range(4):
        d.policies["prefill"].pick([p], session)  # type: ignore[list-item]
        groups.append(d.new_room(p, session) % 2)
        session = session + [turn, turn]
    assert len(set(groups)) == 1, groups
    fresh = [d.new_room(p, [i, i]) % 2 for i in range(4)]  # four new prefixes
    assert sorted(fresh) == [0, 0, 1, 1], fresh
    rooms = [d.new_room(p, [3, 3]) for _ in range(50)]
    assert len(set(rooms)) == 50 and 0 not in rooms


def test_prefill_dp_groups_are_balanced_by_their_load() -> None:
    """The worker reports each DP group's queue and KV (GetLoad's dp_groups) and the gateway
    counts its own requests in flight per group: a prompt every request shares (a system prompt)
    stays in its group only within the load bound, and a new one goes to the least-loaded
    group. With a least-load prefill policy each room goes to the least-loaded group."""
    import itertools

    from gateway.dispatcher import Dispatcher
    from gateway.routing import CacheAware, LeastLoad
    from gateway.workers import Worker
    from protocol import tandem_pb2

    d = Dispatcher.__new__(Dispatcher)
    d._rooms = itertools.count(10)
    d.policies = {"prefill": CacheAware(page_size=2, load_threshold=2.0)}
    p = Worker.__new__(Worker)
    p.url, p.group_inflight = "p", {}
    p.info = tandem_pb2.WorkerInfo(bootstrap_addr="h:1;h:2;h:3")
    p.load = tandem_pb2.Load(dp_groups=[
        tandem_pb2.GroupLoad(running=1, kv_used_pages=5, kv_total_pages=10),
        tandem_pb2.GroupLoad(running=0), tandem_pb2.GroupLoad(running=3)])
    assert p.group_loads(3) == [1.5, 0.0, 3.0]
    system = [1, 2, 3, 4]
    first = d.new_room(p, system) % 3
    assert first == 1  # a new prefix: the least-loaded group
    p.group_inflight = {1: 2}  # two requests of ours in flight there: 2.0 <= 0.0 + 1.5 + 2
    assert d.new_room(p, system + [5, 6]) % 3 == 1
    p.group_inflight = {1: 4}  # 4.0 against group 0's 1.5: past the bound, spill
    assert d.new_room(p, system + [7, 8]) % 3 == 0
    p.info = tandem_pb2.WorkerInfo(bootstrap_addr="h:1;h:2;h:3", role="prefill")
    p.pool, p.member, p.draining, p.refusal, p.healthy = "prefill", None, False, "", True
    listed = p.as_json()["dp_groups"]  # GET /workers shows each group's share
    assert [(g["running"], g["inflight"]) for g in listed] == [(1, 0), (0, 4), (3, 0)]
    p.load = tandem_pb2.Load()  # a report without groups (an older worker): ours alone count
    assert p.group_loads(3) == [0.0, 4.0, 0.0]
    d.policies = {"prefill": LeastLoad()}
    assert {d.new_room(p, system) % 3 for _ in range(6)} == {0, 2}


async def test_a_dp_prefill_workers_busy_group_is_passed_over_end_to_end(tok_dir):
    """Through the gateway: a prefill worker with two DP groups ("a;b" bootstrap addresses)
    reports group 0 busy in GetLoad; every request gets a room in group 1, and GET /workers
    lists both groups."""
    p, d = prefill(), decode()
    p.bootstrap_addr = "127.0.0.1:1;127.0.0.1:2"
    p.load = tandem_pb2.Load(kv_total_pages=100, running=20, dp_groups=[
        tandem_pb2.GroupLoad(running=20, kv_total_pages=50),
        tandem_pb2.GroupLoad(running=0, kv_total_pages=50)])
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d],
                                                    prefill_policy="cache_aware")) as c:
        await wait_workers(c)
        while not any(w.get("dp_groups") for w in (await c.get("/workers")).json()):
            await asyncio.sleep(0.02)  # the first GetLoad lands
        for i in range(4):  # new prompts: drawn in turn they alternated groups
            r = await c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 5})
            assert r.status_code == 200, r.text
        assert [req.disagg.room % 2 for req in p.requests] == [1, 1, 1, 1]
        ws = (await c.get("/workers")).json()
        groups = next(w for w in ws if w["role"] == "prefill")["dp_groups"]
        assert [(g["running"], g["inflight"]) for g in groups] == [(20, 0), (0, 0)]
