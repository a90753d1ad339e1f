"""Test doubles for the gateway: a tokenizer built offline and scripted gRPC workers.

`ScriptedWorker` is a real grpc.aio server implementing the Worker service and grpc.health.v1;
it yields scripted tokens instead of running a model (the real workers are tested end to end
elsewhere). Roles: "both" streams every token; "prefill" yields one message (first token +
num_cached_tokens) for a PD request; "decode" streams every token, the last message with
transfer stats. Faults are scripted per instance and recorded calls are kept for assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gateway.app import create_app
from gateway.config import GatewayConfig
from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.errors import ERROR_CODE_KEY


@dataclass
class Script:
    """What a ScriptedWorker does on Generate."""

    tokens: list[int] = field(default_factory=list)  # output token ids, one per message
    finish_reason: str = "length"
    cached_tokens: int = 0
    delay_s: float = 0.0  # between messages
    first_delay_s: float = 0.0  # before the first message (decode: the KV "arriving" after prefill)
    fail_code: grpc.StatusCode | None = None  # abort the stream with this code ...
    fail_after: int = 0  # ... after this many messages (0 = before the first)
    fail_times: int = 1_000_000  # how many Generate calls fail (then it behaves)
    hang_first: bool = False  # never send the first message (first-token timeout)
    transfer: tandem_pb2.TransferStats | None = None
    # A token more likely than every scripted one (as when sampling picks below the top): the
    # top logprobs lead with it. None: each scripted token is its own top.
    rival: int | None = None


class ScriptedWorker(tandem_pb2_grpc.WorkerServicer):
    def __init__(self, role: str = "both", model: str = "tiny", max_model_len: int = 64,
                 vocab_size: int = 300, script: Script | None = None) -> None:
        self.role = role
        self.model = model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.script = script or Script()
        self.requests: list[tandem_pb2.GenerateRequest] = []
        self.aborts: list[tandem_pb2.AbortRequest] = []
        self.cancelled = 0
        self.sessions = 0  # Session streams opened to this worker
        self.frames = 0  # gateway frames received on them
        self.load = tandem_pb2.Load(kv_total_pages=100)
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.abort_event = asyncio.Event()
        self.bootstrap_addr = ""  # prefill: "" = 127.0.0.1:<port + 1>
        self.epoch = 1

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, serving: bool = True, port: int = 0) -> ScriptedWorker:
        # as the real worker: a port something else holds fails the bind (grpc's default,
        # SO_REUSEPORT, would share it with another test process's double)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        tandem_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        async with bounded(f"a scripted worker's start on port {self.port}"):
            await self.server.start()
            await self.set_serving(serving)
        return self

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self.health.set("", status.SERVING if serving else status.NOT_SERVING)

    async def stop(self) -> None:
        if self.server is not None:
            async with bounded(f"a scripted worker's stop on port {self.port}"):
                await self.server.stop(grace=None)

    async def GetInfo(self, request, context):  # noqa: N802 (gRPC method names)
        return tandem_pb2.WorkerInfo(
            model=self.model,
            role=self.role,
            max_model_len=self.max_model_len,
            page_size=4,
            vocab_size=self.vocab_size,
            eos_token_ids=[2],
            epoch=self.epoch,
            bootstrap_addr=self._bootstrap(),
        )

    def _bootstrap(self) -> str:
        if self.role != "prefill":
            return ""
        return self.bootstrap_addr or f"127.0.0.1:{self.port + 1}"

    async def GetLoad(self, request, context):  # noqa: N802
        return self.load

    async def Abort(self, request, context):  # noqa: N802
        self.aborts.append(request)
        self.abort_event.set()
        return tandem_pb2.AbortResponse(found=True)

    def respond(self, request: tandem_pb2.GenerateRequest
                ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        """One request's messages, for Generate and the Session stream alike: subclasses
        override this (raising ScriptedFailure fails the request)."""
        return self._script(request)

    async def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        try:
            async for msg in self.respond(request):
                yield msg
        except ScriptedFailure as f:
            meta = ((ERROR_CODE_KEY, f.error_code),) if f.error_code else None
            await context.abort(f.code, f.details, trailing_metadata=meta)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def Session(self, request_iterator, context):  # noqa: N802
        """The gateway's stream: each submit runs the script in a task of its own; whatever
        the tasks produced by the time the writer runs goes out as one message (a "step")."""
        pending: list[tuple[int, Scripted]] = []
        wake = asyncio.Event()
        tasks: dict[int, asyncio.Task[None]] = {}
        ids: dict[int, tandem_pb2.GenerateRequest] = {}  # slot -> its request

        async def run(slot: int, request: tandem_pb2.GenerateRequest) -> None:
            try:
                finished = False
                async for msg in self.respond(request):
                    pending.append((slot, msg))
                    finished = finished or bool(msg.finish_reason)
                    wake.set()
                if not finished:  # a prefill leg: one message, then the call's end
                    pending.append((slot, None))
            except ScriptedFailure as f:
                pending.append((slot, f))
            except asyncio.CancelledError:
                self.cancelled += 1
                pending.append((slot, tandem_pb2.GenerateResponse(finish_reason="abort")))
            finally:
                tasks.pop(slot, None)
                ids.pop(slot, None)
                wake.set()

        async def read() -> None:
            async for frame in request_iterator:
                self.frames += 1
                # The real worker's order: ids and rooms, then submits, then slots.
                for ab in frame.aborts:
                    if ab.request_id or ab.room:  # what the Abort call used to carry
                        self.aborts.append(tandem_pb2.AbortRequest(
                            request_id=ab.request_id, room=ab.room, attempt_id=ab.attempt_id))
                        self.abort_event.set()
                        for slot, req in list(ids.items()):
                            if _aborts(ab, req):
                                tasks[slot].cancel()
                for sub in frame.submits:
                    self.requests.append(sub.request)
                    ids[sub.slot] = sub.request
                    tasks[sub.slot] = asyncio.get_running_loop().create_task(
                        run(sub.slot, sub.request))
                for ab in frame.aborts:
                    if ab.slot in tasks:
                        tasks[ab.slot].cancel()

        self.sessions += 1
        reader = asyncio.get_running_loop().create_task(read())
        started: set[int] = set()
        try:
            while not reader.done() or tasks or pending:
                await wake.wait()
                wake.clear()
                if pending:
                    batch, pending[:] = list(pending), []
                    await context.write(session_message(batch, started))
        finally:  # end every task of this stream before the handler returns (clean teardown)
            reader.cancel()
            for t in list(tasks.values()):
                t.cancel()
            await asyncio.gather(reader, *tasks.values(), return_exceptions=True)

    async def _script(self, request: tandem_pb2.GenerateRequest
                      ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        s = self.script
        failing = s.fail_code is not None and s.fail_times > 0
        if failing:
            s.fail_times -= 1
        if s.hang_first:
            await asyncio.sleep(3600)
        if failing and s.fail_after == 0:
            raise ScriptedFailure(s.fail_code)
        if s.first_delay_s:
            await asyncio.sleep(s.first_delay_s)
        n_prompt = len(request.prompt_token_ids)
        if self.role == "prefill":  # the first token; at the room's end the transfer stats
            yield tandem_pb2.GenerateResponse(token_ids=s.tokens[:1], num_prompt_tokens=n_prompt,
                                              num_cached_tokens=s.cached_tokens)
            if s.transfer is not None:
                await asyncio.sleep(s.delay_s)
                yield tandem_pb2.GenerateResponse(finish_reason="stop", transfer=s.transfer)
            return
        n = min(len(s.tokens), request.sampling.max_tokens or len(s.tokens))
        for i in range(n):
            if failing and i == s.fail_after:
                raise ScriptedFailure(s.fail_code)
            last = i == n - 1
            msg = tandem_pb2.GenerateResponse(token_ids=[s.tokens[i]])
            if request.sampling.logprobs:
                top = [tandem_pb2.TopLogprob(token_id=s.tokens[i], logprob=-0.5)]
                if s.rival is not None:
                    top.insert(0, tandem_pb2.TopLogprob(token_id=s.rival, logprob=-0.25))
                msg.logprobs.append(tandem_pb2.TokenLogprob(
                    token_id=s.tokens[i], logprob=-0.5, top=top[:request.sampling.top_logprobs]))
            if i == 0:
                msg.num_prompt_tokens = n_prompt
                msg.num_cached_tokens = 0 if self.role == "decode" else s.cached_tokens
            if last:
                limit_hit = n < len(s.tokens)
                msg.finish_reason = "length" if limit_hit else s.finish_reason
                if s.transfer is not None:
                    msg.transfer.CopyFrom(s.transfer)
            yield msg
            if s.delay_s and not last:
                await asyncio.sleep(s.delay_s)


def _aborts(ab: tandem_pb2.SessionAbort, req: tandem_pb2.GenerateRequest) -> bool:
    """Whether `ab` ends `req`, as the real worker decides (an attempt id ends only it)."""
    if ab.room and ab.room == req.disagg.room:
        return True
    if ab.attempt_id:
        return ab.attempt_id == req.attempt_id
    return bool(ab.request_id) and ab.request_id == req.request_id


class ScriptedAbort:
    """The script ends the request "abort" on the worker's own account, saying why."""

    finish_reason = "abort"

    def __init__(self, reason: str) -> None:
        self.reason = reason


class ScriptedFailure(Exception):
    """The script fails the request with this status code (and the worker's error class)."""

    def __init__(self, code: grpc.StatusCode, details: str = "", error_code: str = "") -> None:
        super().__init__(code.name)
        self.code = code
        self.details = details or f"scripted {code.name}"
        self.error_code = error_code


Scripted = tandem_pb2.GenerateResponse | ScriptedAbort | ScriptedFailure | None  # one message


def session_message(batch: list[tuple[int, Scripted]],
                    started: set[int]) -> tandem_pb2.SessionResponse:
    """Per-request messages (None: the script ended) as one Session message."""
    out = tandem_pb2.SessionResponse()
    for slot, msg in batch:
        if isinstance(msg, ScriptedAbort):
            out.ended.add(slot=slot, finish_reason="abort", error=msg.reason)
            continue
        if isinstance(msg, ScriptedFailure):
            out.ended.add(slot=slot, status_code=msg.code.value[0], error=msg.details,
                          error_code=msg.error_code)
            continue
        if slot not in started:
            started.add(slot)
            n_prompt = msg.num_prompt_tokens if msg is not None else 0
            n_cached = msg.num_cached_tokens if msg is not None else 0
            out.started.add(slot=slot, num_prompt_tokens=n_prompt, num_cached_tokens=n_cached)
        if msg is None:
            out.ended.add(slot=slot)
            continue
        if msg.token_ids:
            out.slots.append(slot)
            out.num_tokens.append(len(msg.token_ids))
            out.token_ids.extend(msg.token_ids)
            out.num_logprobs.append(len(msg.logprobs))
            out.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            end = out.ended.add(slot=slot, finish_reason=msg.finish_reason)
            if msg.HasField("transfer"):
                end.transfer.CopyFrom(msg.transfer)
    return out


def fast_config(tok_dir: Path, **kw: object) -> GatewayConfig:
    base = GatewayConfig(model_path=str(tok_dir), health_interval_s=0.05, load_interval_s=0.05,
                         startup_wait_s=5.0, first_token_timeout_s=5.0, request_timeout_s=20.0)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_app(config: GatewayConfig) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, and a client bound to it in-process."""
    app = create_app(config)
    lifespan = app.router.lifespan_context(app)
    async with bounded("the gateway's start"):
        await lifespan.__aenter__()
    try:
        async with httpx.AsyncClient(
            transport=_BoundedASGI(app=app), base_url="http://gw", timeout=20
        ) as client:
            yield client
    finally:
        async with bounded("the gateway's stop"):
            await lifespan.__aexit__(None, None, None)


class _BoundedASGI(httpx.ASGITransport):
    """httpx applies no timeout to an in-process app: a request the gateway never answered
    held its test until pytest's 300 s timeout, and the shared event loop's runner failed every
    gateway test after it (anyio WouldBlock). Bounded, it fails in a minute, named."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        async with bounded(f"{request.method} {request.url.path}", seconds=60.0):
            return await super().handle_async_request(request)


@contextlib.asynccontextmanager
async def bounded(step: str, seconds: float = 15.0) -> AsyncIterator[None]:
    """A test double's step that must end: one that hangs fails its test, naming the step."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise AssertionError(f"{step} did not end within {seconds:g} s") from None


@contextlib.asynccontextmanager
async def workers(*ws: ScriptedWorker) -> AsyncIterator[tuple[ScriptedWorker, ...]]:
    for w in ws:
        await w.start()
    try:
        yield ws
    finally:
        for w in ws:
            await w.stop()


async def wait_workers(
    client: httpx.AsyncClient, healthy: bool = True, timeout: float = 5.0
) -> list[dict]:
    """Poll GET /workers until every worker's `healthy` equals `healthy` (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        ws = (await client.get("/workers")).json()
        if all(w["healthy"] is healthy for w in ws) or loop.time() > deadline:
            return ws
        await asyncio.sleep(0.02)
