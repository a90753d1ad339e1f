"""The gateway's Session streams: one per worker, batched frames, a broken stream fails
exactly the requests it carried (an error, never a hang) and the next request reconnects."""

from __future__ import annotations

import asyncio
import json

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


async def test_pushed_outputs_skip_the_reader_until_one_is_refused_or_ends_the_stream():
    """Leg.push_to: what the sink takes never reaches `read`; a refused output is queued and
    pushing stops; ENDED makes the next read the end while the leg can still be aborted."""
    from gateway.session import Leg, Output, Push
    from protocol import tandem_pb2

    seen: list[list[int]] = []
    verdicts = [Push.TAKEN, Push.TAKEN, Push.REFUSED]

    def sink(out: Output) -> Push:
        seen.append(out.token_ids)
        return verdicts.pop(0)

    leg = Leg(None, 1)  # type: ignore[arg-type]  # fed by hand: no stream needed
    leg.push_to(sink)
    for t in (70, 71, 72, 73):
        leg._push(Output([t], []))
    assert seen == [[70], [71], [72]]  # 73 came after the refusal: queued, not offered
    assert (await leg.read()).token_ids == [72, 73]  # the refused one and what followed
    offered: list[tuple[list[int], str]] = []

    def until_the_end(out: Output) -> Push:
        offered.append((out.token_ids, out.finish_reason))
        return Push.REFUSED if out.finish_reason else Push.TAKEN

    leg.push_to(until_the_end)  # the reader hands the stream back
    leg._push(Output([74], []))
    leg._end(tandem_pb2.RequestEnd(slot=1, finish_reason="length"))
    assert offered == [([74], ""), ([], "length")]  # the end was whole when first offered
    final = await leg.read()
    assert final.token_ids == [] and final.finish_reason == "length"
    assert await leg.read() is grpc.aio.EOF

    ended = Leg(None, 2)  # type: ignore[arg-type]
    ended.push_to(lambda out: Push.ENDED)  # a stop string in this output
    ended._push(Output([70], []))
    assert not ended.done()  # ended here, not by the worker: it is still to be aborted
    # The worker's own end in the same message (queued: pushing stopped) is not read.
    ended._end(tandem_pb2.RequestEnd(slot=2, finish_reason="length"))
    assert await ended.read() is grpc.aio.EOF


async def test_a_failing_sink_fails_the_read_even_with_outputs_queued_behind_it():
    from gateway.session import Leg, Output

    def sink(out: Output):
        raise ValueError("parser bug")

    leg = Leg(None, 1)  # type: ignore[arg-type]
    leg.push_to(sink)
    leg._push(Output([70], []))  # dropped: its text can never be sent
    leg._push(Output([71], []))  # queued behind the failure
    with pytest.raises(ValueError, match="parser bug"):
        await leg.read()


class _Direct:
    """The DirectChunks face StreamEvents.sink uses: writable() and put()."""

    def __init__(self) -> None:
        self.open = True
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return self.open

    def put(self, chunk: bytes) -> None:
        assert self.open and chunk  # what the sink checked before putting it
        self.writes.append(chunk)


def test_stream_events_sink_writes_takes_and_refuses_as_the_task_would(tok_dir):
    """Pushed outputs give the bytes the task's loop gives for the same outputs; the sink
    refuses the finishing output and anything while the client cannot take a write, and ends
    the stream at a stop string."""
    from gateway.metrics import TokenClock
    from gateway.output import OutputAssembler
    from gateway.session import Output, Push
    from gateway.streaming import StreamEvents
    from gateway.tokenizer import Tokenizer

    class _Itl:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, v: float, count: int = 1) -> None:
            self.values += [v] * count

    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode(" one two three four", add_special_tokens=False)

    def events(stops: list[str]) -> tuple[StreamEvents, _Direct, _Itl]:
        out = OutputAssembler(tok, [1, 2], True, stops, -1)
        itl = _Itl()
        stream = StreamEvents("r1", "tiny", out, None, TokenClock(itl, 1))  # type: ignore[arg-type]
        stream.attach(_Direct())  # type: ignore[arg-type]
        assert stream.direct is not None
        return stream, stream.direct, itl  # type: ignore[return-value]

    pushed, direct, itl = events([])
    by_task, _, _ = events([])
    assert pushed.sink(Output([ids[0]], [])) is Push.TAKEN
    assert direct.writes == [b"".join(by_task.of(Output([ids[0]], [])))]
    assert len(itl.values) == 1  # a token's latency, recorded as it arrived
    direct.open = False  # the client's transport paused
    assert pushed.sink(Output([ids[1]], [])) is Push.REFUSED and len(direct.writes) == 1
    direct.open = True
    last = Output([ids[2]], [])
    last.finish_reason = "length"
    assert pushed.sink(last) is Push.REFUSED  # the task writes the end, usage and [DONE]

    stopped, direct, _ = events(["three"])
    verdicts = []
    for t in ids:  # the leg stops offering after ENDED
        verdicts.append(stopped.sink(Output([t], [])))
        if verdicts[-1] is Push.ENDED:
            break
    assert verdicts[-1] is Push.ENDED and len(verdicts) < len(ids)
    texts = [json.loads(w[6:])["choices"][0] for w in direct.writes]
    assert "".join(c["text"] for c in texts) == tok.decode(ids).split("three")[0]
    assert texts[-1]["finish_reason"] == "stop"


async def test_a_leg_past_request_timeout_ends_with_504_and_an_abort(tok_dir):
    """gateway.request_timeout_s bounds a whole request on its stream (the session's sweep,
    not a timer per leg): a worker still streaming past it has the request ended (504, an
    abort on the stream) soon after the timeout; the stream itself lives on."""
    w = ScriptedWorker(script=Script(tokens=[70 + i % 50 for i in range(80)], delay_s=0.05),
                       max_model_len=128)
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,),
                                                   request_timeout_s=0.6)) as c:
        await wait_workers(c)
        t0 = asyncio.get_running_loop().time()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 80})
        took = asyncio.get_running_loop().time() - t0
        assert r.status_code == 504 and r.json()["error"]["message"].endswith(
            "DEADLINE_EXCEEDED: Deadline Exceeded: the request ran past 0.6 s "
            "(gateway.request_timeout_s)")  # the gateway's bound, not the worker's failure
        assert 0.6 <= took < 3.0, took  # 80 tokens would take 4 s
        for _ in range(100):  # the abort reaches the worker
            if w.cancelled:
                break
            await asyncio.sleep(0.01)
        assert w.cancelled == 1
        metrics = (await c.get("/metrics")).text  # the gateway's own bound: no worker's fault
        assert not [x for x in metrics.splitlines()
                    if x.startswith("tandem_worker_faults_total{") and not x.endswith(" 0.0")]
        w.script = Script(tokens=[70], finish_reason="stop")
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200 and w.sessions == 1


async def test_a_request_timeout_before_the_first_token_is_not_retried_nor_blamed(tok_dir):
    """request_timeout_s ran out before any token (a prompt the worker was still on): the
    request ends with the 504 at once. Retrying it elsewhere would run past its own bound, and
    the worker did nothing wrong, so no fault is charged to it."""
    a, b = (ScriptedWorker(script=Script(tokens=[70], first_delay_s=3.0), max_model_len=128)
            for _ in range(2))
    async with workers(a, b), running_app(fast_config(
            tok_dir, workers=(a.url, b.url), request_timeout_s=0.5)) as c:
        await wait_workers(c)
        t0 = asyncio.get_running_loop().time()
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        took = asyncio.get_running_loop().time() - t0
        assert r.status_code == 504, r.text
        assert "(gateway.request_timeout_s)" in r.json()["error"]["message"]
        assert took < 1.6, took  # one attempt: a retry would add another 0.5 s and more
        metrics = (await c.get("/metrics")).text
        assert "tandem_retries_total 0.0" in metrics, metrics
        assert not [x for x in metrics.splitlines()
                    if x.startswith("tandem_worker_faults_total{") and not x.endswith(" 0.0")]


async def test_wait_done_returns_at_the_tasks_end_or_the_timeout_and_never_raises():
    from gateway.stalls import wait_done

    loop = asyncio.get_running_loop()

    async def sleeper(s: float) -> None:
        await asyncio.sleep(s)

    async def failing() -> None:
        raise RuntimeError("prefill leg failed")

    t0 = loop.time()
    quick = asyncio.create_task(sleeper(0.05))
    await wait_done(quick, 5.0)
    assert quick.done() and loop.time() - t0 < 2.0
    slow = asyncio.create_task(sleeper(5.0))
    t0 = loop.time()
    await wait_done(slow, 0.1)
    assert not slow.done() and 0.1 <= loop.time() - t0 < 2.0  # left running, not cancelled
    slow.cancel()
    bad = asyncio.create_task(failing())
    await wait_done(bad, 5.0)  # its error is the task's, not the waiter's
    assert isinstance(bad.exception(), RuntimeError)
