"""The worker's side of a Session: one long-lived gRPC stream per gateway.

Lifecycle of one stream (`SessionFront.run`, on the server's event loop):
 1. The gateway opens `Session`; a reader task takes its frames. Each `Submit` is validated
    (the same checks as Generate) and posted to the engine with this stream's channel and the
    submit's slot as tag; a refused submit ends at once with its status code. Each
    `SessionAbort` ends its slot (and request id, and room) on the engine.
 2. The engine's loop delivers one `StepOutputs` per step to the channel (worker/outputs.py).
    `deliver` only appends the batch and, when the front is not already awake, schedules one
    wake-up on the event loop: one thread hop per step, whatever the batch size.
 3. The writer turns every queued batch into one `SessionResponse` by list extends (columns,
    no per-request Python loop for tokens) and writes it.
 4. When the stream ends (the gateway closed or vanished), every request still live on it is
    aborted, so its pages are freed; outputs the engine delivers later are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from protocol import tandem_pb2
from protocol.errors import PEER_TIMEOUT
from worker.engine import Engine
from worker.outputs import OutputChannel, RequestEnded, StepOutputs
from worker.request import Request

log = logging.getLogger("tandem.worker")

# The engine's error classes (Request.error_code) as the status codes the gateway acts on.
STATUS_BY_ERROR = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "resource": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "peer": grpc.StatusCode.ABORTED,  # the room's other side failed it: retry elsewhere
    PEER_TIMEOUT: grpc.StatusCode.ABORTED,  # ... because it stopped answering in time
    "internal": grpc.StatusCode.INTERNAL,
}
_CODE_NUMBER = {code: code.value[0] for code in grpc.StatusCode}


class InvalidRequest(ValueError):
    """The request is the client's mistake (maps to INVALID_ARGUMENT)."""


class Registry:
    """What the server keeps about live requests so that Abort by id, attempt or room finds
    them. An attempt id ("<request id>/<n>", the gateway's retry) ends only that attempt: a late
    Abort of attempt 0 never ends attempt 1 on this worker; a request id alone ends them all."""

    def __init__(self) -> None:
        self._by_key: dict[str, set[str]] = collections.defaultdict(set)  # id or attempt -> ours
        self._by_room: dict[int, str] = {}
        self._keys: dict[str, tuple[str, ...]] = {}  # ours -> the keys it is filed under

    def __len__(self) -> int:
        return len(self._keys)

    def live(self) -> list[str]:
        """Our ids of every live request."""
        return list(self._keys)

    def add(self, req: Request, request_id: str, attempt_id: str = "") -> None:
        keys = tuple(k for k in (request_id, _attempt_key(attempt_id)) if k)
        self._keys[req.request_id] = keys
        for key in keys:
            self._by_key[key].add(req.request_id)
        if req.room:
            self._by_room[req.room] = req.request_id

    def remove(self, req: Request) -> None:
        for key in self._keys.pop(req.request_id, ()):
            ids = self._by_key.get(key)
            if ids is not None:
                ids.discard(req.request_id)
                if not ids:
                    del self._by_key[key]
        if req.room and self._by_room.get(req.room) == req.request_id:
            del self._by_room[req.room]

    def find(self, request_id: str, attempt_id: str, room: int) -> set[str]:
        key = _attempt_key(attempt_id) or request_id
        ids = set(self._by_key.get(key, ())) if key else set()
        if room and room in self._by_room:
            ids.add(self._by_room[room])
        return ids


def _attempt_key(attempt_id: str) -> str:
    return f"attempt:{attempt_id}" if attempt_id else ""


class SessionChannel(OutputChannel):
    """The engine's view of one stream: batches queue here until the writer takes them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self.pending: collections.deque[StepOutputs] = collections.deque()
        self.scheduled = False  # a wake-up is queued on the loop (reset there before draining)
        self.closed = False

    def deliver(self, outputs: StepOutputs) -> None:  # engine thread
        if self.closed:
            return
        self.pending.append(outputs)  # deque.append is atomic: no lock with the loop's popleft
        if not self.scheduled:
            self.scheduled = True
            self._loop.call_soon_threadsafe(self._wake)

    def post(self, outputs: StepOutputs) -> None:  # event loop: outputs made by the front
        self.pending.append(outputs)
        self._wake()


def fill_response(msg: tandem_pb2.SessionResponse, out: StepOutputs) -> list[int]:
    """Append one batch to `msg`; returns the slots that ended in it."""
    msg.slots.extend(out.tags)
    msg.num_tokens.extend(out.num_tokens)
    msg.token_ids.extend(out.token_ids)
    msg.num_logprobs.extend(out.num_logprobs)
    for lp in out.logprobs:  # only requests that asked for logprobs have entries here
        entry = msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for t, v in lp.top:
            entry.top.add(token_id=t, logprob=v)
    for tag, num_prompt, num_cached in out.started:
        msg.started.add(slot=tag, num_prompt_tokens=num_prompt, num_cached_tokens=num_cached)
    ended = []
    for end in out.ended:
        e = msg.ended.add(slot=end.tag, finish_reason=end.finish_reason)
        if end.finish_reason == "error":
            code = STATUS_BY_ERROR.get(end.error_code, grpc.StatusCode.INTERNAL)
            e.finish_reason, e.status_code, e.error = "", _CODE_NUMBER[code], end.error
            e.error_code = end.error_code  # the class, for the gateway's blame ("peer_timeout")
        elif end.finish_reason == "abort":
            e.error = end.error  # why the worker ended it (a drain's deadline, a room's)
        if end.transfer:
            e.transfer.pages = int(end.transfer.get("pages", 0))
            e.transfer.bytes = int(end.transfer.get("bytes", 0))
            e.transfer.duration_ms = float(end.transfer.get("duration_ms", 0.0))
        ended.append(end.tag)
    return ended


def refused(slot: int, code: grpc.StatusCode, error: str) -> StepOutputs:
    """A submit ended before it reached the engine."""
    out = StepOutputs()
    out.ended.append(RequestEnded(slot, "error", error, _error_class(code)))
    return out


def _error_class(code: grpc.StatusCode) -> str:
    return next((k for k, v in STATUS_BY_ERROR.items() if v == code), "internal")


class SessionFront:
    """One Session stream on the worker (see the module docstring for its lifecycle)."""

    def __init__(self, engine_of: Callable[[], Engine | None],
                 make_request: Callable[[Engine, Any], Request], max_waiting: int,
                 registry: Registry, draining: Callable[[], bool]) -> None:
        self._engine_of = engine_of  # None until the worker is loaded and warmed up
        self._make_request = make_request
        self._max_waiting = max_waiting
        self._registry = registry
        self._draining = draining  # the drain refuses new requests (worker/drain.py)
        self._compiling: dict[int, asyncio.Task[None]] = {}  # slot -> its grammar's compile
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()
        self.channel = SessionChannel(self._loop, self._wake)
        self._live: dict[int, Request] = {}  # slot -> every request live on this stream

    def _wake(self) -> None:
        self.channel.scheduled = False  # first: a batch delivered from now on schedules again
        self._woken.set()

    async def run(self, frames: AsyncIterator[tandem_pb2.SessionRequest],
                  context: grpc.aio.ServicerContext) -> None:
        reader = asyncio.get_running_loop().create_task(self._read(frames))
        try:
            while not (reader.done() and not self._live and not self.channel.pending):
                await self._woken.wait()
                self._woken.clear()
                msg = self._drain()
                if msg is not None:
                    await context.write(msg)
                if reader.done() and reader.exception() is not None:
                    break
        finally:
            reader.cancel()
            self.close()

    def _drain(self) -> tandem_pb2.SessionResponse | None:
        pending = self.channel.pending
        if not pending:
            return None
        msg = tandem_pb2.SessionResponse()
        while pending:
            for slot in fill_response(msg, pending.popleft()):
                req = self._live.pop(slot, None)
                if req is not None:
                    self._registry.remove(req)
        return msg

    async def _read(self, frames: AsyncIterator[tandem_pb2.SessionRequest]) -> None:
        try:
            async for frame in frames:
                # The order of protocol/tandem.proto's SessionRequest: ids and rooms (earlier
                # frames' requests), then submits, then slots.
                for ab in frame.aborts:
                    if ab.request_id or ab.room:
                        self._abort_ids(ab.request_id, ab.attempt_id, ab.room)
                if frame.submits:
                    self._submit(frame.submits)
                for ab in frame.aborts:
                    if ab.slot:
                        self._abort_slot(ab.slot)
        finally:
            self._wake()  # the writer re-checks whether the stream is over

    def _submit(self, submits: Any) -> None:
        engine = self._engine_of()
        why = ("worker is starting up" if engine is None else
               "worker is draining: it takes no new requests" if self._draining() else "")
        if engine is None or why:  # the gateway retries these elsewhere
            for s in submits:
                self.channel.post(refused(s.slot, grpc.StatusCode.UNAVAILABLE, why))
            return
        waiting = sum(s.stats().waiting for s in engine.schedulers)
        for s in submits:
            try:
                req = self._make_request(engine, s.request)
            except ValueError as exc:  # InvalidRequest and SamplingParamsError
                self.channel.post(refused(s.slot, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                continue
            if waiting >= self._max_waiting:
                self.channel.post(refused(s.slot, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          "worker queue is full; retry later"))
                continue
            waiting += 1
            self._live[s.slot] = req
            self._registry.add(req, s.request.request_id, s.request.attempt_id)
            if req.sampling.structured is None:
                engine.submit_to(req, self.channel, s.slot)
            else:  # compiled off the event loop and the engine thread (a big schema takes a while)
                self._compiling[s.slot] = self._loop.create_task(
                    self._compile_then_submit(engine, req, s.slot))

    async def _compile_then_submit(self, engine: Engine, req: Request, slot: int) -> None:
        structured = req.sampling.structured
        assert structured is not None
        try:
            await self._loop.run_in_executor(None, engine.grammars.compile, structured)
        except ValueError as exc:  # SamplingParamsError: the schema or grammar is invalid
            self._end_unsubmitted(slot, refused(slot, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        finally:
            self._compiling.pop(slot, None)
        if slot in self._live and not self.channel.closed:
            engine.submit_to(req, self.channel, slot)

    def _end_unsubmitted(self, slot: int, end: StepOutputs) -> None:
        """A request that never reached the engine ends here (refused, or aborted while its
        grammar compiled)."""
        req = self._live.pop(slot, None)
        if req is not None:
            self._registry.remove(req)
            self.channel.post(end)

    def _abort_ids(self, request_id: str, attempt_id: str, room: int) -> None:
        engine = self._engine_of()
        if engine is None:
            return
        ids = self._registry.find(request_id, attempt_id, room)
        for slot in [k for k, req in self._live.items() if req.request_id in ids]:
            if slot in self._compiling:
                self._abort_compiling(slot)
        for rid in ids:
            engine.abort(rid, "aborted")

    def _abort_slot(self, slot: int) -> None:
        engine = self._engine_of()
        req = self._live.get(slot)
        if slot in self._compiling:
            self._abort_compiling(slot)
        elif engine is not None and req is not None:
            engine.abort(req.request_id, "aborted")

    def _abort_compiling(self, slot: int) -> None:
        self._compiling.pop(slot).cancel()  # the executor's compile still fills the cache
        end = StepOutputs()
        end.ended.append(RequestEnded(slot, "abort", "", ""))
        self._end_unsubmitted(slot, end)

    def close(self) -> None:
        """The stream is over: drop later outputs, end every request it still carried."""
        self.channel.closed = True
        for task in self._compiling.values():
            task.cancel()
        live, self._live = self._live, {}
        engine = self._engine_of()
        for req in live.values():
            self._registry.remove(req)
            if engine is not None:
                engine.abort(req.request_id, "the gateway's session ended")
        if live:
            log.info("session closed with %d live requests; aborted them", len(live))
