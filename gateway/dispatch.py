"""Dispatch of one request to the workers, with retry before the first token.

Every leg rides its worker's one Session stream (gateway/session.py): `Worker.session.open`
gives a leg that reads like a streaming call, and aborts go on the same stream.

Monolithic: one leg on a `workers` worker; it streams every output token.

Disaggregated (PD), for one attempt:
 1. Take a seat on a decode worker (gateway/admission.py: wait in the gateway's queue while
    every healthy decode worker is full), pick a prefill worker (its policy sees the prompt);
    draw a random 64-bit `room`; take the prefill worker's `bootstrap_addr` from its GetInfo.
 2. Send `Generate(disagg={room, bootstrap_addr}, attempt_id)` to both at once.
 3. The prefill leg yields the first token (with `num_cached_tokens`) and, once the room has
    ended, a last message with the KV transfer stats; it is read by a task that keeps
    `num_cached_tokens` for usage, counts the transfer in the metrics and watches for errors.
    The transfer is counted from this leg because it ends with the room, before or while the
    decode leg streams: a request the gateway ends early (a stop string, a client gone) never
    reads the decode leg's last message, but its prefill leg is left a moment to finish.
 4. The decode leg streams all output tokens; its first message carries the token prefill
    sampled.
 5. If either leg fails before the first token reaches the client, both calls are cancelled,
    `Abort(request_id, room, attempt_id)` goes to both workers, and — when the failure is a
    worker's (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ABORTED) — one retry runs on a new pair
    without the worker blamed (ABORTED on a PD leg blames the other leg's worker: the room's
    other side failed it). After the first token a stream has no retry (the client has its
    tokens): the error goes to the client. A JSON answer's client has seen nothing yet, so a
    worker's fault there ends the attempt and runs the request again from its prompt
    (`RequestRun.restart`), on the same terms: once per request, a new pair.

Retries cannot hurt: each attempt has its own `attempt_id` ("<request id>/<n>"; the request id
stays for logs) and Abort names it, so a late Abort of attempt 1 never ends attempt 2 on the
same worker; and a leg that ends with finish_reason "abort" the gateway did not ask for is a
failed attempt (retried, or a 5xx), never an answer.

After the first token, a stream with no message for `gateway.stream_stall_timeout_s` ends with
an error (the handler sends it as an SSE error event), Abort goes to both legs, and the worker
that went quiet is marked suspect (health checks bring it back). The same deadline bounds the
wait for decode's first message once the prefill leg ended well (the KV and the first token
are on decode, which needs only to send it): past it the attempt fails and is retried.

`RequestRun.abort()` (client gone, stop string) cancels the streams and sends Abort to every
worker involved. A worker's UNAVAILABLE marks it suspect in the pool at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from gateway.dispatcher import Dispatcher
from gateway.errors import NoHealthyWorker, WorkerCallError
from gateway.pool import Worker
from gateway.session import Output, Push
from gateway.stalls import DeadlinePassed, FirstTokenDeadline, _timeout, wait_done
from protocol import tandem_pb2
from protocol.bootstrap_addr import group_of

log = logging.getLogger(__name__)

_EOF = grpc.aio.EOF


class RequestRun:
    """One request's streams. `first()` (with retry), then `next()` until None; `close()` always."""

    def __init__(self, d: Dispatcher, request_id: str, prompt_ids: list[int],
                 sampling: tandem_pb2.SamplingParams, prefer: Worker | None = None) -> None:
        self._d = d
        self.prefer = prefer
        # The worker that computes the prompt in the live attempt (mono, or prefill): after the
        # first token its prefix cache holds the prompt's pages.
        self.prompt_worker: Worker | None = None
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.room = 0
        self.attempt_id = ""  # "<request id>/<n>" of the live attempt (Abort names it)
        self.num_cached_tokens = 0
        self.retried = False
        self._attempt = 0  # the next attempt's number (its attempt_id's suffix)
        self._exclude: set[str] = set()  # workers a retry avoids (blamed for a failed attempt)
        self._legs: list[tuple[Worker, Any]] = []  # (worker, grpc call) of the live attempt
        self._stream: Any = None  # the call that streams output tokens (mono or decode leg)
        self._stream_worker: Worker | None = None
        self._prefill_task: asyncio.Task[None] | None = None
        self._aborted = False
        self.reading_since = 0.0  # monotonic time the output stream's pending read began (0: none)
        self._watched = False  # registered with the StallWatch
        self._stall_hit = False  # the StallWatch cancelled the stream

    # ---- first token, with one retry ----

    async def first(self) -> Output:
        """The first output; a worker's fault before it runs the request once more on a new
        pair without the worker blamed (unless gateway.retry_before_first_token is off)."""
        return await self._attempts(1 if self._d.config.retry_before_first_token else 0)

    async def restart(self, err: WorkerCallError) -> Output:
        """`err` ended the run past its first output while the client has seen none of it (a
        JSON answer): end this attempt and run the request again from its prompt, on the terms
        of a retry before the first token (the request's one retry, a worker's fault, a new
        pair without the worker blamed); its first output. Raises `err` otherwise."""
        self._end_attempt(abort=True)
        if not (err.worker_fault and self._d.config.retry_before_first_token
                and not self.retried and not self._aborted):
            raise err
        self._retry_after(err)
        return await self._attempts(0)

    async def _attempts(self, retries: int) -> Output:
        cfg = self._d.config
        while True:
            self.attempt_id = f"{self.request_id}/{self._attempt}"
            self._attempt += 1
            try:
                if cfg.pd:
                    return await self._attempt_pd(self._exclude)
                return await self._attempt_mono(self._exclude)
            except WorkerCallError as err:
                self._end_attempt(abort=True)
                if err.worker_fault:
                    self._d.blame(err)
                if not retries or not err.worker_fault:
                    raise
                retries -= 1
                self._retry_after(err)

    def _retry_after(self, err: WorkerCallError) -> None:
        """Book the retry `err` calls for; raises `err` when no new pair is healthy (then the
        original error is the better answer)."""
        self._exclude.add(err.blamed_url)
        log.debug("request %s: retrying after %s", self.request_id, err.message)
        self._d.metrics.retries.inc()
        self.retried = True
        try:
            self._d.check_pairs(self._exclude)
        except NoHealthyWorker:
            raise err from None

    def _request(self, disagg: tandem_pb2.DisaggParams | None = None
                 ) -> tandem_pb2.GenerateRequest:
        return tandem_pb2.GenerateRequest(
            request_id=self.request_id, attempt_id=self.attempt_id,
            prompt_token_ids=self.prompt_ids, sampling=self.sampling, disagg=disagg)

    def _open(self, w: Worker, req: tandem_pb2.GenerateRequest, group: int = -1) -> Any:
        """A leg on `w` (a prefill leg: in its DP group `group`, counted there until it left)."""
        call = w.session.open(req, self._d.config.request_timeout_s,
                              on_left=lambda: self._d.left(w, group))
        w.inflight += 1
        if group >= 0:
            w.group_inflight[group] = w.group_inflight.get(group, 0) + 1
        self._legs.append((w, call))
        return call

    async def _read_first(self, call: Any, w: Worker, leg: str) -> Output:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._fail(exc, w, leg) from None
        if msg is _EOF:
            raise WorkerCallError(grpc.StatusCode.INTERNAL, "stream ended before any message",
                                  w.url, leg)
        self._check_abort(msg, w, leg)
        return msg

    def _check_abort(self, msg: Output, w: Worker, leg: str) -> None:
        """finish_reason "abort" that the gateway did not ask for is a failed attempt: never an
        answer. Prefill ends "abort" when decode gave the room up (decode's fault: ABORTED
        blames the other leg); decode or mono when the worker itself gave up (UNAVAILABLE)."""
        if msg.finish_reason != "abort" or self._aborted:
            return
        self._d.metrics.unasked_aborts.labels(leg).inc()
        code = grpc.StatusCode.ABORTED if leg == "prefill" else grpc.StatusCode.UNAVAILABLE
        why = f": {msg.reason}" if msg.reason else " (its room or the worker gave up)"
        raise WorkerCallError(code, "the worker ended the request with finish_reason 'abort' "
                              f"although nobody asked{why}", w.url, leg)

    def _fail(self, exc: grpc.aio.AioRpcError, w: Worker, leg: str) -> WorkerCallError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._d.pool.mark_suspect(w, f"its {leg} leg was UNAVAILABLE ({exc.details()})")
        err = WorkerCallError.from_rpc(exc, w.url, leg)
        if "bootstrap" in err.details.lower():
            self._d.metrics.bootstrap_failures.inc()
        return err

    def _first_token_timeout(self, w: Worker, leg: str) -> WorkerCallError:
        s = self._d.config.first_token_timeout_s
        return WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no first token within {s} s "
                               "(gateway.first_token_timeout_s)", w.url, leg)

    async def _attempt_mono(self, exclude: set[str]) -> Output:
        w = self.prompt_worker = self._d.pick("workers", self.prompt_ids, exclude, self.prefer)
        call = self._open(w, self._request())
        cfg = self._d.config  # no prefill leg to end it early: the deadline is the timeout
        deadline = FirstTokenDeadline(call, cfg.first_token_timeout_s, cfg.stream_stall_timeout_s)
        try:
            first = await self._read_first(call, w, "mono")
        except DeadlinePassed:
            raise self._first_token_timeout(w, "mono") from None
        finally:
            deadline.stop()
        self.num_cached_tokens = first.num_cached_tokens
        self._stream, self._stream_worker = call, w
        return first

    async def _attempt_pd(self, exclude: set[str]) -> Output:
        d = await self._d.take_seat(self.prompt_ids, exclude)
        # no await since the seat: it holds
        p = self.prompt_worker = self._d.pick("prefill", self.prompt_ids, exclude, self.prefer)
        assert p.info is not None  # healthy implies GetInfo answered
        self.room = self._d.new_room(p, self.prompt_ids)
        req = self._request(tandem_pb2.DisaggParams(room=self.room,
                                                    bootstrap_addr=p.info.bootstrap_addr))
        groups = self._d.dp_groups(p)
        call_p = self._open(p, req, group_of(self.room, groups) if groups > 1 else -1)
        call_d = self._open(d, req)
        try:
            return await self._first_pd(call_p, p, call_d, d)
        except WorkerCallError as err:
            if err.peer_fault:  # the room's other side failed it: blame that worker
                other = p if err.leg == "decode" else d
                err.blamed_url, err.blamed_pool = other.url, other.pool
                if err.peer_timeout:  # it stopped answering: out until its checks say so
                    self._d.pool.mark_suspect(other, f"the {err.leg} worker {err.worker_url} timed "
                                              "out waiting on it (a room's other side)")
            raise

    async def _first_pd(self, call_p: Any, p: Worker, call_d: Any, d: Worker
                        ) -> Output:
        """Decode's first token while the prefill leg runs beside it (a task: it reads on to
        the room's end). A prefill failure before that token is the attempt's error."""
        cfg = self._d.config
        prefill = self._prefill_task = asyncio.get_running_loop().create_task(
            self._prefill_leg(call_p, p), name=f"prefill leg of {self.request_id}")
        # Before the first token the deadline raises this leg's error; after it, or while the
        # gateway shuts down, the error changes nothing and must not surface "never retrieved".
        prefill.add_done_callback(_retrieve)
        deadline = FirstTokenDeadline(call_d, cfg.first_token_timeout_s,
                                      cfg.stream_stall_timeout_s)
        prefill.add_done_callback(deadline.prefill_ended)
        try:
            first = await self._read_first(call_d, d, "decode")
        except DeadlinePassed:
            if deadline.landed:  # decode has all it needs and says nothing: it went quiet
                raise self._stalled(d, "decode", cfg.stream_stall_timeout_s) from None
            raise self._first_token_timeout(d, "decode") from None
        except WorkerCallError as err:
            if err.leg == "decode" and err.worker_fault:
                self._d.metrics.kv_transfer_failures.inc()  # the KV never landed on decode
            raise
        finally:
            deadline.stop()
        self._stream, self._stream_worker = call_d, d
        return first

    async def _prefill_leg(self, call: Any, w: Worker) -> None:
        first = await self._read_first(call, w, "prefill")
        self.num_cached_tokens = first.num_cached_tokens
        self._count_transfer(first)
        try:
            while (msg := await call.read()) is not _EOF:
                self._count_transfer(msg)
                self._check_abort(msg, w, "prefill")
        except grpc.aio.AioRpcError as exc:
            raise self._fail(exc, w, "prefill") from None

    def _count_transfer(self, msg: Output) -> None:
        if msg.transfer is not None and msg.transfer.bytes:
            self._d.metrics.observe_transfer(msg.transfer)

    # ---- after the first token ----

    async def next(self) -> Output | None:
        """The next message of the output stream; None at its end. Errors are not retried; a
        stall past `gateway.stream_stall_timeout_s` (the StallWatch) is one."""
        w = self._stream_worker
        assert w is not None
        leg = "decode" if self.room else "mono"
        if not self._watched:
            self._watched = True
            self._d.stalls.add(self)
        self.reading_since = time.monotonic()
        try:
            msg = await self._stream.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stall_hit and not (task is not None and task.cancelling()):
                raise self._stalled(w, leg, self._d.stalls.stall_s, blame=True) from None
            raise  # the client left: the handler aborts the request
        except grpc.aio.AioRpcError as exc:
            if self._stall_hit:
                raise self._stalled(w, leg, self._d.stalls.stall_s, blame=True) from None
            err = self._fail(exc, w, leg)
            if err.worker_fault:
                self._d.blame(err)
            raise err from None
        finally:
            self.reading_since = 0.0
        if msg is _EOF:
            return None
        self._check_abort(msg, w, leg)
        return msg

    def push(self, sink: Callable[[Output], Push]) -> None:
        """Hand the output stream's next outputs to `sink` as they arrive (Leg.push_to): the
        pending `next()` returns only what it refuses, the end, or an error. A pushed output
        counts as a message for the stall watch."""
        assert self._stream is not None

        def take(msg: Output) -> Push:
            self.reading_since = time.monotonic()
            return sink(msg)

        self._stream.push_to(take)

    def stall(self) -> None:
        """The StallWatch saw no message for stall_s: end the read (next() reports it)."""
        if self._stream is not None and not self._stall_hit:
            self._stall_hit = True
            self._stream.cancel()

    def _stalled(self, w: Worker, leg: str, stall: float, blame: bool = False
                 ) -> WorkerCallError:
        """No token for `stall` s: the worker went quiet (frozen, hung). `blame`: charge it
        now (after the first token; before it, `first()` charges the failed attempt)."""
        self._d.metrics.stream_stalls.labels(w.pool).inc()
        self._d.pool.mark_suspect(w, f"no token for {stall:g} s (gateway.stream_stall_timeout_s)")
        err = WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no token for {stall:g} s "
                              "(gateway.stream_stall_timeout_s); the request was aborted on "
                              "its workers", w.url, leg)
        if blame:
            self._d.blame(err)
        return err

    async def settle(self) -> None:
        """After the final message: read the stream's end (the worker has closed it, so this is
        immediate, and cheaper on both sides than cancelling a call that already finished), and
        wait briefly for the prefill leg's end: its first message's num_cached_tokens feeds
        usage, its last carries the room's transfer stats (which a stop string's abort, sent
        right after, would cut off)."""
        call = self._stream
        if call is not None and not call.done():
            try:
                async with _timeout(1.0):
                    while await call.read() is not _EOF:
                        pass
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                pass  # the answer is complete; close() cancels whatever is left
        task = self._prefill_task
        if task is not None and not task.done():
            await wait_done(task, 1.0)

    def abort(self) -> None:
        """Client gone or stop string: cancel the streams and Abort on every worker. Idempotent."""
        if self._aborted:
            return
        self._aborted = True
        self._end_attempt(abort=True)

    def close(self) -> None:
        """End the legs still open (`Dispatcher.left`); always called once the response is done."""
        self._end_attempt(abort=False)

    def _end_attempt(self, abort: bool) -> None:
        task = self._prefill_task
        draining: Any = None  # the prefill call left to deliver its last message
        if task is not None:
            if not task.done() and self._stream is not None and self.room:
                # Past the first token the room is done or about to be: let the prefill leg
                # read its last message (the transfer stats) rather than cut it off.
                draining = next((c for w, c in self._legs if c is not self._stream), None)
                _drain(task, draining)
            elif not task.done():
                task.cancel()
            self._prefill_task = None
        req = tandem_pb2.AbortRequest(request_id=self.request_id, room=self.room,
                                      attempt_id=self.attempt_id) if abort else None
        for w, call in self._legs:
            if not call.done() and call is not draining:
                call.cancel()
            if req is not None:
                _send_abort(w, req)
        self._legs.clear()
        self._stream = None
        if self._watched:
            self._watched = False
            self._d.stalls.discard(self)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a prefill leg's error read (past the first token it changes nothing; before it,
    `_first_pd` raises it)."""
    exc = None if task.cancelled() else task.exception()
    if exc is not None:
        log.debug("%s ended with %s", task.get_name(), exc)


def _drain(task: asyncio.Task[None], call: Any, timeout_s: float = 2.0) -> None:
    """Give a prefill leg `timeout_s` to end by itself (its last message carries the room's
    transfer stats), then cut it off: one timer, cancelled when the leg ends. At shutdown the
    sessions end every leg, which cancels the timer too."""
    def cut() -> None:
        if not task.done():
            task.cancel()
            if call is not None:
                call.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, cut)
    task.add_done_callback(lambda _: timer.cancel())


def _send_abort(w: Worker, req: tandem_pb2.AbortRequest) -> None:
    """Abort on the worker's stream: ordered after the submit, never lost to a race. Without a
    stream (it broke) the worker has already ended everything the stream carried."""
    w.session.abort(req.request_id, req.room, req.attempt_id)
