"""The gateway's Session streams: one per worker, batched frames, a broken stream fails
exactly the requests it carried (an error, never a hang) and the next request reconnects."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.gateway.gw_doubles import (
    Script,
    ScriptedWorker,
    fast_config,
    running_app,
    wait_workers,
    workers,
)

pytestmark = pytest.mark.anyio


async def test_many_requests_ride_one_stream(tok_dir):
    w = ScriptedWorker(script=Script(tokens=[70, 71, 72], finish_reason="stop", delay_s=0.005))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        await wait_workers(c)
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "hi",
                                                                    "max_tokens": 3})
                                    for _ in range(24)))
        assert all(r.status_code == 200 for r in rs)
        assert all(r.json()["usage"]["completion_tokens"] == 3 for r in rs)
        assert len(w.requests) == 24 and w.sessions == 1
        assert w.frames < 24  # submits that queued together left together
        assert w.aborts == [] and w.cancelled == 0


async def test_broken_stream_fails_its_requests_and_reconnects(tok_dir):
    slow = Script(tokens=list(range(70, 90)), finish_reason="stop", delay_s=0.05)
    w = ScriptedWorker(script=slow)
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        await wait_workers(c)
        body = {"prompt": "hi", "max_tokens": 20}
        pending = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
        while len(w.requests) < 3 or w.abort_event.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # every request has its first token: no retry is allowed now
        port = w.port
        await w.stop()  # the worker goes away with three requests on its stream
        rs = await asyncio.wait_for(asyncio.gather(*pending), 10)  # answered, not hung
        assert all(r.status_code == 503 for r in rs), [r.text for r in rs]
        assert all("session stream broke" in r.json()["error"]["message"] for r in rs)
        w.script = Script(tokens=[70], finish_reason="stop")
        await w.start(port=port)  # back on the same address
        await wait_workers(c)
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert w.sessions == 2  # a new stream


async def test_a_reader_that_fell_behind_gets_one_merged_output():
    from gateway.session import Leg, Output
    from protocol import tandem_pb2

    leg = Leg(None, 1)  # type: ignore[arg-type]  # fed by hand: no stream needed
    leg._start = (5, 2)
    first = Output([70], [])
    leg._push(first)
    leg._push(Output([71, 72], []))
    leg._end(tandem_pb2.RequestEnd(slot=1, finish_reason="length",
                                   transfer=tandem_pb2.TransferStats(pages=1, bytes=64)))
    out = await leg.read()
    assert out.token_ids == [70, 71, 72] and out.finish_reason == "length"
    assert (out.num_prompt_tokens, out.num_cached_tokens) == (5, 2) and out.transfer.bytes == 64
    assert await leg.read() is grpc.aio.EOF and leg.done()


class _Leg:
    """What FirstTokenDeadline drives: the interrupt of a leg's read."""

    def __init__(self) -> None:
        self.interrupts: list[BaseException | None] = []

    def interrupt(self, exc: BaseException | None) -> None:
        self.interrupts.append(exc)


async def test_first_token_deadline_shortens_when_prefill_lands_and_stops_clean():
    from gateway.stalls import DeadlinePassed, FirstTokenDeadline

    async def ok():
        return None

    async def failed():
        raise RuntimeError("prefill failed")

    leg = _Leg()
    deadline = FirstTokenDeadline(leg, timeout_s=30.0, stall_s=0.05)
    task = asyncio.create_task(ok())
    task.add_done_callback(deadline.prefill_ended)
    await asyncio.sleep(0.2)  # landed: the stall bound (0.05 s), not 30 s, ends the wait
    assert deadline.landed and isinstance(leg.interrupts[0], DeadlinePassed)

    leg = _Leg()
    deadline = FirstTokenDeadline(leg, timeout_s=30.0, stall_s=30.0)
    task = asyncio.create_task(failed())
    task.add_done_callback(deadline.prefill_ended)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert leg.interrupts == [task.exception()] and not deadline.landed
    deadline.stop()  # the first token came anyway: the error not raised yet is withdrawn
    assert leg.interrupts[-1] is None
