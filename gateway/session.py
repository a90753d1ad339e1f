"""The gateway's one Session stream per worker, and the demultiplexer of its outputs.

Every request the gateway sends a worker rides the same long-lived bidirectional gRPC stream
(`Worker.Session`, protocol/tandem.proto) instead of a call of its own:

 1. `WorkerSession.open(request)` gives the request a slot (unique on this stream), queues a
    `Submit`, and returns its `Leg`. A writer task sends everything queued since its last
    write as one frame, so a burst of requests costs one message, not one call each.
 2. The worker answers with one `SessionResponse` per engine step, columns for all requests
    of this stream. The reader task splits it by slot into one `Output` per request and
    wakes that request's reader (`Leg.read`): no per-request gRPC machinery at all. A
    streamed response's leg has its outputs pushed instead (`Leg.push_to`): the reader hands
    each to the response's sink, which writes its events to the client in the same pass, and
    the request's task is woken only at the end (gateway/streaming.py).
 3. `Leg.cancel()` and `WorkerSession.abort()` queue a `SessionAbort` on the same stream, so
    an abort can never overtake the submit it aborts. Each leg has its own deadline.
 4. A broken stream (worker gone, restarted, network) fails exactly the legs it carried, at
    once, with UNAVAILABLE; the next `open` opens a new stream (reconnect).

`Leg` reads like the grpc.aio call it replaces: `read()` returns the next output or
`grpc.aio.EOF`, errors raise `grpc.aio.AioRpcError` with the worker's status code, so the
dispatch code (gateway/dispatch.py) keeps its retry and abort rules unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.errors import ERROR_CODE_KEY, REQUEST_TIMEOUT

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str, error_code: str = ""
              ) -> grpc.aio.AioRpcError:
    """The error a leg raises: the same type a failed grpc.aio call raises; the worker's error
    class (RequestEnd.error_code) rides in its trailing metadata, as a Generate call's would."""
    trailing = grpc.aio.Metadata((ERROR_CODE_KEY, error_code)) if error_code \
        else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


class Output:
    """One request's share of one worker message (the fields of GenerateResponse it uses)."""

    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens",
                 "num_cached_tokens", "transfer", "reason")

    def __init__(self, token_ids: list[int], logprobs: list[Any]) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs  # TokenLogprob messages, one per token when asked
        self.finish_reason = ""
        self.reason = ""  # why the worker ended it "abort" on its own (RequestEnd.error)
        self.num_prompt_tokens = 0  # set on a request's first output
        self.num_cached_tokens = 0
        self.transfer: tandem_pb2.TransferStats | None = None  # PD decode: on the last output


class Push(enum.Enum):
    """A push sink's answer for one output (`Leg.push_to`)."""

    TAKEN = "taken"  # handled; the reader is not woken
    REFUSED = "refused"  # not handled: queued for the reader, and pushing stops
    ENDED = "ended"  # handled, and it ended the output here: the reader's next read is the end


class Leg:
    """One request on a worker's stream; read it like a grpc.aio streaming call, or have its
    outputs pushed to a sink as they arrive (`push_to`)."""

    __slots__ = ("_session", "slot", "_queue", "_waiter", "_ended", "_error", "_cancelled",
                 "deadline", "timeout_s", "_start", "_interrupt", "_sink", "_sink_error",
                 "_pushed_end", "_on_left")

    def __init__(self, session: WorkerSession, slot: int) -> None:
        self._session = session
        self.slot = slot
        self._queue: collections.deque[Output] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the worker ended it (its last output may still be queued)
        self._error: grpc.aio.AioRpcError | None = None
        self._cancelled = False
        self.deadline = float("inf")  # loop time past which the session's sweep ends it
        self.timeout_s = 0.0  # the request's whole time (gateway.request_timeout_s): its error
        self._start: tuple[int, int] | None = None  # (num_prompt, num_cached) not yet handed on
        self._interrupt: BaseException | None = None  # raised by the next read with nothing queued
        self._sink: Callable[[Output], Push] | None = None
        self._sink_error: Exception | None = None  # what the sink raised: the next read's
        self._pushed_end = False  # the sink ended the output (a stop string): reads are EOF
        # Called once when the leg leaves its stream (the worker ended it, it failed, it was
        # cancelled or expired): the worker holds it no more, though its outputs may still be
        # queued here unread (gateway/dispatch.py frees its decode seat then).
        self._on_left: Callable[[], None] | None = None

    async def read(self) -> Output | Any:
        """Everything that arrived since the last read, as one output (several steps' tokens
        when the reader fell behind: one detokenizer pass and one client event for all of
        them); `grpc.aio.EOF` after the last; raises the leg's error once its outputs are read."""
        while True:
            if self._sink_error is not None:
                raise self._sink_error
            if self._pushed_end:  # what came after the end the sink chose is not the client's
                return _EOF
            if self._queue:
                return self._take()
            if self._cancelled:
                raise asyncio.CancelledError
            if self._interrupt is not None:
                exc, self._interrupt = self._interrupt, None
                raise exc
            if self._error is not None:
                raise self._error
            if self._ended:
                return _EOF
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def done(self) -> bool:
        return self._ended or self._cancelled or self._error is not None

    def interrupt(self, exc: BaseException | None) -> None:
        """Make the pending read (or the next one that finds nothing queued) raise `exc`: the
        request's other leg failed, or a deadline passed. The leg itself goes on. None
        withdraws an interrupt not raised yet."""
        self._interrupt = exc
        if exc is not None:
            self._wake()

    def push_to(self, sink: Callable[[Output], Push]) -> None:
        """From now on each output goes to `sink` as it arrives (called by the session's reader,
        in the pass that splits the worker's message), while nothing is queued; `read` then
        returns only what the sink refused (queued, and pushing stops), the end, or an error:
        the worker's, or what the sink raised (pushing stops and the output is dropped)."""
        self._sink = sink

    def _offer(self, out: Output) -> bool:
        """Give `out` to the sink; False when it must be queued instead."""
        assert self._sink is not None
        try:
            verdict = self._sink(out)
        except Exception as exc:  # raised to the reader, whose request fails with it
            self._sink, self._sink_error = None, exc
            self._wake()
            return True
        if verdict is Push.TAKEN:
            return True
        self._sink = None
        if verdict is Push.REFUSED:
            return False
        self._pushed_end = True
        self._wake()
        return True

    def _take(self) -> Output:
        queue = self._queue
        out = queue.popleft()
        while queue:
            more = queue.popleft()
            out.token_ids += more.token_ids
            if more.logprobs:
                out.logprobs += more.logprobs
            out.finish_reason, out.reason = more.finish_reason, more.reason
            if more.transfer is not None:
                out.transfer = more.transfer
        return out

    def cancel(self) -> None:
        """Stop reading; the worker ends the request (a SessionAbort on the stream)."""
        if self.done():
            return
        self._cancelled = True
        self._session._forget(self, abort=True)
        self._wake()

    # ---- fed by the session -----------------------------------------------------------------

    def _left(self) -> None:
        on_left, self._on_left = self._on_left, None
        if on_left is not None:
            on_left()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, out: Output) -> None:
        if self._start is not None:
            out.num_prompt_tokens, out.num_cached_tokens = self._start
            self._start = None
        if self._sink is not None and not self._queue and self._offer(out):
            return
        self._queue.append(out)
        self._wake()

    def _end(self, end: tandem_pb2.RequestEnd) -> None:
        if end.status_code:
            code = _STATUS.get(end.status_code, grpc.StatusCode.UNKNOWN)
            self._fail(rpc_error(code, end.error, end.error_code))
            return
        transfer = end.transfer if end.HasField("transfer") else None
        last = self._queue[-1] if self._queue else None  # not read yet: it can carry the end
        if last is not None and self._start is None:
            last.finish_reason, last.reason = end.finish_reason, end.error
            if transfer is not None:
                last.transfer = transfer
        elif self._start is not None or end.finish_reason or transfer is not None:
            final = Output([], [])  # whole before it is pushed: a sink sees it once
            final.finish_reason, final.reason = end.finish_reason, end.error
            final.transfer = transfer
            self._push(final)
        self._ended = True
        self._wake()

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        if self.done():
            return
        self._error = error
        self._wake()

    def _expire(self) -> None:
        if not self.done():
            self._session._forget(self, abort=True)
            # The gateway's own bound, named as such (a bare "Deadline Exceeded" from a
            # worker's address read as the worker's failure).
            self._fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded: the "
                                 f"request ran past {self.timeout_s:g} s "
                                 "(gateway.request_timeout_s)", REQUEST_TIMEOUT))


class WorkerSession:
    """The stream to one worker, opened on first use and again after it breaks."""

    def __init__(self, stub: tandem_pb2_grpc.WorkerStub, url: str) -> None:
        self._stub = stub
        self.url = url
        self._slots = itertools.count(1)
        self._legs: dict[int, Leg] = {}
        self._frame = tandem_pb2.SessionRequest()  # what the writer sends next
        self._kick = asyncio.Event()  # set when _frame has something
        self._call: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._period = 1.0  # how often the sweep looks for legs past their deadline
        self.num_streams = 0  # streams opened so far (reconnects = num_streams - 1)

    @property
    def live(self) -> int:
        """Requests on the stream that have not ended."""
        return len(self._legs)

    def open(self, request: tandem_pb2.GenerateRequest, timeout_s: float,
             on_left: Callable[[], None] | None = None) -> Leg:
        """Send `request` on the stream; its outputs arrive on the returned leg, which ends
        with DEADLINE_EXCEEDED (and an abort to the worker) within a tenth of `timeout_s`
        (at most 1 s) after `timeout_s`. `on_left` is called once when the leg leaves the
        stream, however it ends (not when its last output is read)."""
        self._period = max(0.01, min(self._period, timeout_s / 10))
        if self._call is None:
            self._connect()
        slot = next(self._slots)
        leg = Leg(self, slot)
        leg._on_left = on_left
        self._legs[slot] = leg
        self._frame.submits.add(slot=slot, request=request)
        self._kick.set()
        leg.deadline = asyncio.get_running_loop().time() + timeout_s
        leg.timeout_s = timeout_s
        return leg

    def abort(self, request_id: str, room: int, attempt_id: str = "") -> None:
        """End the requests with this id (only its attempt `attempt_id`, when given) and this
        room on the worker; idempotent."""
        if self._call is None:
            return  # no stream: the worker already ended what the broken one carried
        self._frame.aborts.add(request_id=request_id, room=room, attempt_id=attempt_id)
        self._kick.set()

    def _forget(self, leg: Leg, abort: bool) -> None:
        if self._legs.pop(leg.slot, None) is None:
            return
        if abort and self._call is not None:
            self._frame.aborts.add(slot=leg.slot)
            self._kick.set()
        leg._left()

    # ---- the stream -----------------------------------------------------------------------

    def _connect(self) -> None:
        call = self._stub.Session()
        self._call = call
        self.num_streams += 1
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(call)), loop.create_task(self._read(call)),
                       loop.create_task(self._sweep())]

    async def _write(self, call: Any) -> None:
        try:
            while True:
                await self._kick.wait()
                if len(self._legs) > 1:  # others in flight: one more turn gathers their submits
                    await asyncio.sleep(0)
                self._kick.clear()
                frame, self._frame = self._frame, tandem_pb2.SessionRequest()
                await call.write(frame)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.debug("session to %s: write failed: %s", self.url, exc)  # the reader reports it

    async def _sweep(self) -> None:
        """End the legs past their deadline: one task per stream, where a timer per leg cost
        ~2 us a request (armed and cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._period)
            now = loop.time()
            for leg in [leg for leg in self._legs.values() if leg.deadline <= now]:
                leg._expire()

    async def _read(self, call: Any) -> None:
        reason = "the worker closed the stream"
        try:
            while True:
                msg = await call.read()
                if msg is _EOF:
                    break
                self._demux(msg)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        finally:
            self._broken(call, reason)

    def _demux(self, msg: tandem_pb2.SessionResponse) -> None:
        legs = self._legs
        for st in msg.started:
            leg = legs.get(st.slot)
            if leg is not None:
                leg._start = (st.num_prompt_tokens, st.num_cached_tokens)
        if msg.slots:
            tokens = list(msg.token_ids)
            lps = msg.logprobs
            # Requests whose last tokens are in this message: those tokens go out marked as the
            # end, so a push sink refuses them and the request's task reads tokens and end as
            # one output. Pushed alone, a stop token was written as text before its end was
            # known (the eos's or a stop_token_ids entry's text ended every streamed answer).
            ending = {e.slot: e.finish_reason for e in msg.ended
                      if not e.status_code} if msg.ended else None
            pos = lpos = 0
            for slot, n, nl in zip(msg.slots, msg.num_tokens, msg.num_logprobs, strict=True):
                leg = legs.get(slot)
                if leg is not None:
                    out = Output(tokens[pos:pos + n], list(lps[lpos:lpos + nl]) if nl else [])
                    if ending:
                        out.finish_reason = ending.get(slot, "")
                    leg._push(out)
                pos += n
                lpos += nl
        for end in msg.ended:
            leg = legs.pop(end.slot, None)
            if leg is not None:
                leg._end(end)
                leg._left()

    def _broken(self, call: Any, reason: str) -> None:
        """Fail exactly the legs this stream carried; the next open reconnects."""
        if self._call is not call:
            return
        self._call = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = []
        self._frame = tandem_pb2.SessionRequest()
        self._kick.clear()
        legs, self._legs = self._legs, {}
        if legs:
            log.warning("session to %s broke (%s): failing its %d requests", self.url, reason,
                        len(legs))
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"session stream broke: {reason}")
        for leg in legs.values():
            leg._fail(error)
            leg._left()

    async def close(self) -> None:
        """Gateway shutdown: end the stream (the worker aborts what it still carried)."""
        call, tasks = self._call, self._tasks
        if call is None:
            return
        call.cancel()
        self._broken(call, "the gateway is shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)
