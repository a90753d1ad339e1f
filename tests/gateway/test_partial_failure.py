"""Partial failure at the gateway, against scripted workers: attempt ids, unasked aborts,
blame, stall deadlines and the decode admission queue (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from protocol import tandem_pb2
from protocol.errors import PEER_TIMEOUT
from tests.gateway.gw_doubles import (
    Script,
    ScriptedAbort,
    ScriptedFailure,
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)
from tests.gateway.test_gateway_pd import TOKENS, decode, pd_config, prefill

pytestmark = pytest.mark.anyio


class SeatedDecode(ScriptedWorker):
    """A decode double that reports `seats` in GetInfo and records its peak concurrency; it can
    end its first `abort_times` calls with finish_reason "abort", or stall after `stall_after`
    messages (never sending the rest)."""

    def __init__(self, seats: int = 0, abort_times: int = 0, stall_after: int = 0,
                 abort_reason: str = "", **script: object) -> None:
        script.setdefault("transfer", tandem_pb2.TransferStats(pages=1, bytes=4, duration_ms=1))
        super().__init__(role="decode", script=Script(tokens=TOKENS, finish_reason="stop",
                                                      **script))  # type: ignore[arg-type]
        self.seats, self.abort_times, self.stall_after = seats, abort_times, stall_after
        self.abort_reason = abort_reason  # said beside the abort, as a drained worker does
        self.live = self.peak = 0

    async def GetInfo(self, request, context):  # noqa: N802
        info = await super().GetInfo(request, context)
        info.max_running_requests = self.seats
        return info

    async def respond(self, request):
        self.live += 1
        self.peak = max(self.peak, self.live)
        try:
            if self.abort_times > 0:
                self.abort_times -= 1
                yield (ScriptedAbort(self.abort_reason) if self.abort_reason  # type: ignore[misc]
                       else tandem_pb2.GenerateResponse(finish_reason="abort"))
                return
            n = 0
            async for msg in super().respond(request):
                yield msg
                n += 1
                if self.stall_after and n >= self.stall_after:
                    await asyncio.sleep(3600)
        finally:
            self.live -= 1


def _metric(text: str, name: str, *labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(lab in line for lab in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_each_attempt_has_its_own_id_and_abort_names_it(tok_dir):
    p = prefill()
    bad, good = decode(fail_code=grpc.StatusCode.UNAVAILABLE), decode()
    async with workers(p, bad, good), running_app(pd_config(tok_dir, [p], [bad, good])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5},
                         headers={"X-Request-Id": "rq"})
        assert r.status_code == 200, r.text
        first, second = p.requests
        rid = first.request_id  # the client's X-Request-Id leads it, unique all the same
        assert rid.startswith("rq-") and second.request_id == rid  # the request id stays
        assert (first.attempt_id, second.attempt_id) == (f"{rid}/0", f"{rid}/1")
        assert bad.requests[0].attempt_id == f"{rid}/0"
        assert good.requests[0].attempt_id == f"{rid}/1"
        await p.abort_event.wait()
        assert [a.attempt_id for a in p.aborts] == [f"{rid}/0"]  # the retry is never aborted


@pytest.mark.parametrize("stream", [False, True])
async def test_unasked_abort_is_retried_never_a_200(tok_dir, stream):
    p = prefill()
    d0, d1 = SeatedDecode(abort_times=1), SeatedDecode()  # round robin starts with d0
    async with workers(p, d0, d1), running_app(pd_config(tok_dir, [p], [d0, d1])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                  "stream": stream})
        assert r.status_code == 200 and "abort" not in r.text, r.text
        # The first attempt's "abort" was retried on the other decode worker, which answered.
        assert len(d0.requests) == 1 and len(d1.requests) == 1 and d0.abort_times == 0
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_unasked_aborts_total", 'leg="decode"') == 1
        assert _metric(m, "tandem_retries_total") == 1


async def test_unasked_abort_twice_is_a_5xx_with_a_message(tok_dir):
    p = prefill()
    d = SeatedDecode(abort_times=2)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code >= 500, r.text
        assert "finish_reason 'abort'" in r.json()["error"]["message"]
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_requests_total", 'outcome="server_error"') == 1
        assert _metric(m, "tandem_requests_total", 'outcome="success"') == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_the_workers_reason_for_an_abort_reaches_the_client(tok_dir, stream):
    """A worker that ends a request "abort" on its own says why (a drain's deadline): the
    client's error carries it, not only that nobody asked."""
    p = prefill()
    d = SeatedDecode(abort_times=2, abort_reason="worker drain timed out after 1 s")
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                  "stream": stream})
        assert r.status_code >= 500, r.text
        assert "worker drain timed out after 1 s" in r.json()["error"]["message"], r.text


async def test_a_room_failed_by_decode_blames_decode_not_prefill(tok_dir):
    """The prefill leg says ABORTED (its room's decode side failed it): the retry avoids that
    decode worker and keeps whichever prefill; /metrics charges decode."""
    p = prefill(fail_code=grpc.StatusCode.ABORTED, fail_times=1)
    d0, d1 = decode(first_delay_s=0.3), decode()
    async with workers(p, d0, d1), running_app(pd_config(tok_dir, [p], [d0, d1])) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert len(p.requests) == 2  # the only prefill worker was not excluded
        assert len(d0.requests) == 1 and len(d1.requests) == 1
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_worker_faults_total", f'worker="{d0.url}"') == 1
        assert _metric(m, "tandem_worker_faults_total", f'worker="{p.url}"') == 0


async def test_stream_stall_errors_within_the_deadline_and_aborts_both_legs(tok_dir):
    p = prefill()
    d = SeatedDecode(stall_after=2, delay_s=0.01)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d], stream_stall_timeout_s=0.5,
                                                    health_interval_s=5.0)) as c:
        await wait_workers(c)
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                  "stream": True})
        took = time.monotonic() - t0
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "stream_stall_timeout_s" in err["message"] and err["code"] == "deadline_exceeded"
        assert took < 0.5 + 1.0, f"the stall took {took:.2f}s to report"
        await d.abort_event.wait()
        await p.abort_event.wait()
        ws = {w["url"]: w for w in (await c.get("/workers")).json()}
        assert ws[d.url]["healthy"] is False  # suspect until its health checks say otherwise
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_stream_stalls_total", 'pool="decode"') == 1
        assert _metric(m, "tandem_worker_faults_total", f'worker="{d.url}"') == 1


async def test_decode_full_requests_wait_at_the_gateway(tok_dir):
    p = prefill()
    d = SeatedDecode(seats=2, delay_s=0.05)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d])) as c:
        await wait_workers(c)

        async def one() -> int:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            return r.status_code

        statuses = await asyncio.gather(*(one() for _ in range(7)))
        assert statuses == [200] * 7
        assert d.peak == 2, f"decode held {d.peak} requests at once with 2 seats"
        assert len(p.requests) == 7
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_queue_wait_seconds_count", 'pool="decode"') == 7
        assert _metric(m, "tandem_queue_wait_seconds_sum", 'pool="decode"') > 0
        assert _metric(m, "tandem_queue_depth", 'pool="decode"') == 0


async def test_full_queue_is_429_and_a_long_wait_is_503_both_with_retry_after(tok_dir):
    p = prefill()
    d = SeatedDecode(seats=1, delay_s=0.3)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d], max_queued_requests=1,
                                                    queue_timeout_s=0.4)) as c:
        await wait_workers(c)
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "hi",
                                                                    "max_tokens": 5})
                                    for _ in range(3)))
        by = sorted(r.status_code for r in rs)
        assert by == [200, 429, 503], [(r.status_code, r.text) for r in rs]
        for r in rs:
            if r.status_code != 200:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] in ("queue_full", "queue_timeout")
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_queue_rejected_total", 'reason="full"') == 1
        assert _metric(m, "tandem_queue_rejected_total", 'reason="timeout"') == 1


async def test_decode_quiet_after_the_kv_landed_is_retried_on_time(tok_dir):
    """The prefill leg ended well (KV and first token are on decode) but decode sends nothing:
    the attempt fails after stream_stall_timeout_s, not first_token_timeout_s, and is retried."""
    p = prefill()
    quiet, good = decode(first_delay_s=30), decode()
    cfg_kw = {"stream_stall_timeout_s": 0.5, "first_token_timeout_s": 20.0}
    async with workers(p, quiet, good), running_app(pd_config(tok_dir, [p], [quiet, good],
                                                              **cfg_kw)) as c:
        await wait_workers(c)
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 0.5 + 1.5
        assert len(quiet.requests) == 1 and len(good.requests) == 1
        m = (await c.get("/metrics")).text
        assert _metric(m, "tandem_worker_faults_total", f'worker="{quiet.url}"') == 1  # once
        assert _metric(m, "tandem_stream_stalls_total", 'pool="decode"') == 1


class TimingOutPrefill(ScriptedWorker):
    """A prefill double whose first Generate fails the way a room whose decode side stopped
    answering does: ABORTED with the error class in trailing metadata."""

    def __init__(self) -> None:
        super().__init__(role="prefill", script=Script(tokens=TOKENS[:1]))
        self.failed = False

    async def respond(self, request):
        if not self.failed:
            self.failed = True
            raise ScriptedFailure(grpc.StatusCode.ABORTED, "deadline in bootstrapping passed",
                                  PEER_TIMEOUT)
        async for msg in super().respond(request):
            yield msg


@pytest.mark.parametrize("timed_out", [True, False])
async def test_a_peer_that_stopped_answering_is_marked_suspect(tok_dir, timed_out):
    p = TimingOutPrefill() if timed_out else prefill(fail_code=grpc.StatusCode.ABORTED,
                                                     fail_times=1)
    d0, d1 = decode(first_delay_s=0.3), decode()
    cfg = {"health_interval_s": 5.0}  # no health check brings d0 back during the test
    async with workers(p, d0, d1), running_app(pd_config(tok_dir, [p], [d0, d1], **cfg)) as c:
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert len(d0.requests) == 1 and len(d1.requests) == 1
        ws = {w["url"]: w for w in (await c.get("/workers")).json()}
        # timed out: d0 stopped answering, so it is out; a plain failure only blames it
        assert ws[d0.url]["healthy"] is (not timed_out)
        assert ws[p.url]["healthy"] is True


async def test_mono_first_token_timeout_retries_then_answers_504(tok_dir):
    """A mono worker that never answers: past first_token_timeout_s the attempt fails and is
    retried on another worker; with none left the client gets 504 and the worker an abort."""
    hung = ScriptedWorker(script=Script(tokens=[70], hang_first=True))
    good = ScriptedWorker(script=Script(tokens=[70, 71], finish_reason="stop"))
    async with workers(hung, good), running_app(fast_config(
            tok_dir, workers=(hung.url, good.url), first_token_timeout_s=0.3,
            prefill_policy="round_robin")) as c:
        await wait_workers(c)
        rs = [await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
              for _ in range(2)]  # round robin: one of the two starts on the hung worker
        assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
        assert len(hung.requests) >= 1 and len(good.requests) == 2  # retried there
    hung = ScriptedWorker(script=Script(tokens=[70], hang_first=True))
    async with workers(hung), running_app(fast_config(
            tok_dir, workers=(hung.url,), first_token_timeout_s=0.3)) as c:
        await wait_workers(c)
        t0 = time.monotonic()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        assert "no first token within 0.3 s" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 3.0
        for _ in range(100):
            if hung.cancelled:
                break
            await asyncio.sleep(0.01)
        assert hung.cancelled == 1  # the attempt was aborted on the worker


async def test_a_stalled_worker_is_logged_as_suspect_without_a_wrong_cause(tok_dir, caplog):
    """The stall marks decode suspect with one WARNING line naming it; the line said 'marked
    unhealthy after UNAVAILABLE' whatever the cause (a stall is a DEADLINE_EXCEEDED, a peer
    timeout an ABORTED), so an operator looked for a dead process that was only frozen."""
    caplog.set_level("INFO", logger="gateway.pool")
    p = prefill()
    d = SeatedDecode(stall_after=2, delay_s=0.01)
    async with workers(p, d), running_app(pd_config(tok_dir, [p], [d], stream_stall_timeout_s=0.5,
                                                    health_interval_s=5.0)) as c:
        await wait_workers(c)
        caplog.clear()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5,
                                                  "stream": True})
        assert "stream_stall_timeout_s" in r.text
    lines = [rec.getMessage() for rec in caplog.records
             if rec.name == "gateway.pool" and d.url in rec.getMessage()]
    assert len(lines) == 1, lines  # one line for the event (not another 'is now unhealthy')
    assert "UNAVAILABLE" not in lines[0], lines
    assert "no token for 0.5 s (gateway.stream_stall_timeout_s)" in lines[0], lines  # the cause
