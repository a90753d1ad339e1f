"""The worker process: the gRPC Worker service and grpc.health.v1 in front of the engine.

Start-up order: bind the port (a worker that cannot bind exits non-zero before it loads
anything, so nothing can mistake another process on that port for it) → health NOT_SERVING
→ load weights → attach the role → warm-up step → SERVING. Until the engine is up, GetInfo
and Generate answer UNAVAILABLE ("starting up").
Shutdown: SIGTERM/SIGINT or `Drain` drain first (worker/drain.py), then the server stops and
the process exits 0; a second signal stops at once.
The engine runs on its own thread; the asyncio loop here only moves messages: a gateway's
`Session` stream (worker/session.py) gets one message per engine step for all its requests;
the per-request `Generate` call stays for direct clients and tools.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc, tls
from protocol.errors import ERROR_CODE_KEY
from protocol.gc_heap import freeze_startup_heap
from protocol.identity import model_fingerprint
from worker.config import WorkerConfig
from worker.drain import Drainer, Holdings
from worker.engine import Engine, RequestOutput
from worker.health import WorkerHealth
from worker.request import Request
from worker.roles import attach
from worker.sampling import SamplingParams, SamplingParamsError
from worker.scheduler import RoleHooks
from worker.session import STATUS_BY_ERROR, InvalidRequest, Registry, SessionFront

log = logging.getLogger("tandem.worker")

__all__ = ["STATUS_BY_ERROR", "InvalidRequest", "WorkerService", "serve", "run_worker"]
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class BindError(RuntimeError):
    """The worker's gRPC port cannot be bound; the message names the address and the fix."""


class WorkerService(tandem_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, drainer: Drainer | None = None) -> None:
        self.config = config
        self.engine: Engine | None = None  # set once weights are loaded
        self.drainer = drainer or Drainer(config.drain_timeout_s)
        # bootstrap_addr, transfer_backend, epoch, contract_hash (PD roles)
        self.role_info: dict[str, str] = {}
        # this incarnation; PD roles report the transfer manager's
        self.epoch = secrets.randbits(64) or 1
        model = config.model
        self.fingerprint = model_fingerprint(served_name(model.path, model.served_model_name),
                                             model.path, model.load_format, model.seed)
        self._ids = itertools.count()
        self._registry = Registry()  # live requests by gateway request id and by room

    # ---- Session: the gateway's stream ---------------------------------------------------
    async def Session(  # type: ignore[override]
            self, request_iterator: AsyncIterator[tandem_pb2.SessionRequest],
            context: grpc.aio.ServicerContext) -> None:
        front = SessionFront(self._ready_engine, self._make_request,
                             self.config.scheduler.max_waiting, self._registry,
                             lambda: self.drainer.draining)
        await front.run(request_iterator, context)

    # ---- Generate ------------------------------------------------------------------------------
    async def Generate(self, request: tandem_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext):
        engine = self._ready_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is starting up")
            return
        if self.drainer.draining:  # the gateway retries it elsewhere before its first token
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "worker is draining: it takes no new requests")
            return
        try:
            req = self._make_request(engine, request)
        except (InvalidRequest, SamplingParamsError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if sum(s.stats().waiting for s in engine.schedulers) >= self.config.scheduler.max_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "worker queue is full; retry later")
            return
        loop = asyncio.get_running_loop()
        if req.sampling.structured is not None:
            try:  # compiled off the event loop (a big schema takes a while); cached for the engine
                await loop.run_in_executor(None, engine.grammars.compile, req.sampling.structured)
            except SamplingParamsError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        # Keyed by the attempt too: an Abort for one attempt must not end a retry here.
        external = request.attempt_id or request.request_id
        self._registry.add(req, request.request_id, request.attempt_id)
        log.debug(
            "request %s (%s): %d prompt tokens", external, req.request_id, req.num_prompt_tokens
        )
        engine.submit(req, sink)
        finished = False
        try:
            while True:
                out = await outputs.get()
                if out.finish_reason == "error":
                    finished = True
                    log.info("request %s failed: %s", external, out.error)
                    code = STATUS_BY_ERROR.get(out.error_code, grpc.StatusCode.INTERNAL)
                    # The error class travels too: "peer_timeout" (the room's other side stopped
                    # answering) lets the gateway mark that worker suspect, not just blame it.
                    await context.abort(code, out.error,
                                        trailing_metadata=((ERROR_CODE_KEY, out.error_code),))
                    return
                finished = out.finished
                yield to_message(out)
                if finished:
                    return
        finally:
            if not finished:  # the caller went away: end the request and free its pages
                engine.abort(req.request_id, "cancelled by the caller")
            self._registry.remove(req)

    def _make_request(self, engine: Engine, message: tandem_pb2.GenerateRequest) -> Request:
        prompt = list(message.prompt_token_ids)
        if not prompt:
            raise InvalidRequest("prompt_token_ids is empty: send at least one token")
        vocab = engine.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        sampling = sampling_from_message(message.sampling)
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequest(f"sampling.logit_bias: token ids out of the vocabulary "
                                 f"[0, {vocab}): {bad[:5]}")
        if len(prompt) + sampling.max_tokens > engine.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context length {engine.max_model_len}; shorten the prompt or lower max_tokens"
            )
        role = self.config.role
        has_room = message.HasField("disagg") and message.disagg.room != 0
        if role != "both" and not has_room:
            raise InvalidRequest(f"this is a {role} worker: requests need disagg.room and "
                                 "disagg.bootstrap_addr")
        rid = f"{message.request_id or 'req'}#{next(self._ids)}"
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            room=message.disagg.room if has_room else 0,
            bootstrap_addr=message.disagg.bootstrap_addr if has_room else "",
        )

    # ---- the other calls -------------------------------------------------------------------------
    async def Abort(self, request: tandem_pb2.AbortRequest,  # type: ignore[override]
                    context: grpc.aio.ServicerContext) -> tandem_pb2.AbortResponse:
        engine = self._ready_engine()
        ids = self._registry.find(request.request_id, request.attempt_id, request.room)
        if engine is not None:
            for rid in ids:
                engine.abort(rid, "aborted")
        return tandem_pb2.AbortResponse(found=bool(ids))

    async def GetLoad(self, request: tandem_pb2.GetLoadRequest,  # type: ignore[override]
                      context: grpc.aio.ServicerContext) -> tandem_pb2.Load:
        return self.load()

    def load(self) -> tandem_pb2.Load:
        """The engine's counters (read from the event loop; GetLoad and the drain use them)."""
        engine = self.engine
        if engine is None:
            return tandem_pb2.Load()
        # One scheduler per attention DP group: the worker's load is their sum.
        stats = [s.stats() for s in engine.schedulers]
        load = tandem_pb2.Load(
            running=sum(st.running for st in stats),
            waiting=sum(st.waiting for st in stats),
            kv_used_pages=sum(st.used_pages for st in stats),
            kv_total_pages=sum(st.total_pages for st in stats),
            kv_cached_pages=sum(st.cached_pages for st in stats),
            prompt_tokens_computed=sum(st.prompt_tokens_computed for st in stats),
            kv_window_used_pages=sum(st.window_used_pages for st in stats),
        )
        if len(stats) > 1:  # per group too: the gateway balances a prefill worker's groups
            load.dp_groups.extend(
                tandem_pb2.GroupLoad(running=st.running, waiting=st.waiting,
                                     kv_used_pages=st.used_pages, kv_total_pages=st.total_pages,
                                     prompt_tokens_computed=st.prompt_tokens_computed)
                for st in stats)
        spec = engine.spec_counters
        if engine.drafter is not None:  # zeros until the first verify: the series exist
            load.spec.CopyFrom(tandem_pb2.SpecLoad(
                draft_tokens=spec.drafted, accepted_tokens=spec.accepted,
                request_steps=spec.request_steps, verify_steps=spec.verify_steps,
                draft_seconds=spec.draft_seconds, verify_seconds=spec.verify_seconds,
                accepted_hist=list(spec.accepted_hist)))
        if engine.hooks is not None:
            rooms, total_bytes, total_pages, waiting = engine.hooks.load_stats()
            load.rooms.update(rooms)
            load.transfer_bytes = total_bytes
            load.transfer_pages = total_pages
            load.waiting += waiting
        return load

    def holdings(self) -> Holdings:
        """What the worker still holds, for the drain."""
        ld = self.load()
        return Holdings(calls=len(self._registry),
                        running=ld.running, waiting=ld.waiting, rooms=sum(ld.rooms.values()),
                        used_pages=ld.kv_used_pages + ld.kv_window_used_pages)

    def abort_all(self, reason: str) -> int:
        """Abort every live request (the drain's deadline passed); returns how many."""
        ids = self._registry.live()
        if self.engine is not None:
            for rid in ids:
                self.engine.abort(rid, reason)
        return len(ids)

    async def Drain(self, request: tandem_pb2.DrainRequest,  # type: ignore[override]
                    context: grpc.aio.ServicerContext) -> tandem_pb2.DrainResponse:
        ld = self.load()
        self.drainer.request(request.reason or "Drain call")
        return tandem_pb2.DrainResponse(running=ld.running, waiting=ld.waiting)

    async def GetInfo(self, request: tandem_pb2.GetInfoRequest,  # type: ignore[override]
                      context: grpc.aio.ServicerContext) -> tandem_pb2.WorkerInfo:
        engine = self._ready_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is starting up")
            raise AssertionError("unreachable")
        model = self.config.model
        return tandem_pb2.WorkerInfo(
            model=served_name(model.path, model.served_model_name),
            role=self.config.role,
            max_model_len=engine.max_model_len,
            page_size=self.config.cache.page_size,
            vocab_size=engine.spec.vocab_size,
            eos_token_ids=list(engine.spec.eos_token_ids),
            bootstrap_addr=self.role_info.get("bootstrap_addr", ""),
            tp_size=self.config.parallel.tp_size,
            epoch=int(self.role_info.get("epoch", self.epoch)),
            transfer_backend=self.role_info.get("transfer_backend", ""),
            cluster_id=self.config.cluster_id,
            replica=self.config.replica,
            model_fingerprint=self.fingerprint,
            contract_hash=self.role_info.get("contract_hash", ""),
            draining=self.drainer.draining,
            max_running_requests=self.config.scheduler.max_num_seqs * len(engine.schedulers),
        )

    def _ready_engine(self) -> Engine | None:
        return self.engine


def served_name(path: str, served_model_name: str) -> str:
    return served_model_name or path.rstrip("/").split("/")[-1]


def sampling_from_message(m: tandem_pb2.SamplingParams) -> SamplingParams:
    params = SamplingParams.from_proto(m)
    params.validate()
    return params


def to_message(out: RequestOutput) -> tandem_pb2.GenerateResponse:
    msg = tandem_pb2.GenerateResponse(
        token_ids=out.token_ids,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    for lp in out.logprobs:
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[tandem_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    if out.transfer:
        msg.transfer.pages = int(out.transfer.get("pages", 0))
        msg.transfer.bytes = int(out.transfer.get("bytes", 0))
        msg.transfer.duration_ms = float(out.transfer.get("duration_ms", 0.0))
    return msg


def _bind(server: grpc.aio.Server, config: WorkerConfig) -> str:
    """Bind the worker's address now, before anything loads; BindError names it and the fix."""
    address = f"{config.host}:{config.port}"
    try:
        port = tls.add_port(server, address, config.tls)
    except RuntimeError:  # grpc raises on a failed bind; older versions returned 0
        port = 0
    if port == 0:
        raise BindError(f"cannot bind {address}: the port is in use (another worker or cluster?) "
                        "or the host is not an address of this machine; pick a free port "
                        "(leave the role's base_port unset and the local launcher chooses one)")
    return address


async def _first_of(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def serve(config: WorkerConfig, stop: asyncio.Event, drainer: Drainer | None = None) -> None:
    """Serve until `stop` is set (at once) or `drainer` is asked to drain (then drained).

    Health turns SERVING after load + warm-up. Raises BindError before loading anything when
    the port cannot be bound.
    """
    config.validate()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a second process on our port must fail, not share it
        ]
    )
    service = WorkerService(config, drainer)
    drainer = service.drainer
    tandem_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = WorkerHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = _bind(server, config)
    await server.start()
    loop = asyncio.get_running_loop()
    engine: Engine | None = None
    roles: RoleHooks | None = None
    loop_stop = threading.Event()
    thread: threading.Thread | None = None
    crashed: list[BaseException] = []

    def run_engine(engine: Engine) -> None:
        try:
            engine.run_forever(loop_stop)
        except BaseException as exc:  # a dead engine must not keep answering SERVING
            log.exception("engine loop died; shutting the worker down")
            crashed.append(exc)
            loop.call_soon_threadsafe(stop.set)

    try:
        log.info("%s worker on %s loading %s", config.role, address, config.model.path)
        engine = await loop.run_in_executor(None, Engine, config)
        roles = await loop.run_in_executor(None, attach_role, engine, config, service)
        await loop.run_in_executor(None, engine.warm_up)
        if roles is not None:
            engine.set_hooks(roles)  # after warm-up: the warm-up request has no room
        freeze_startup_heap()  # the model's and the warm-up's objects: never traversed again
        thread = threading.Thread(target=run_engine, args=(engine,), name="engine", daemon=True)
        thread.start()
        service.engine = engine
        if not drainer.draining:
            health_servicer.set(health_pb2.HealthCheckResponse.SERVING)
            shape = engine.kv.shape
            groups = len(engine.schedulers)
            log.info("ready: %s worker on %s (cluster %s, replica %d; %d KV pages of %d tokens%s; "
                     "KV %s%s)", config.role, address,
                     config.cluster_id or "-", config.replica, shape.num_pages,
                     config.cache.page_size,
                     f" per DP group, {groups} groups" if groups > 1 else "",
                     str(shape.dtype).removeprefix("torch."),
                     f", K/V scales {shape.kv_scales}" if shape.kv_scales else "")
        await _first_of(stop, drainer.requested)
        if not stop.is_set():
            health_servicer.set(health_pb2.HealthCheckResponse.NOT_SERVING)
            drain = asyncio.ensure_future(drainer.run(service.holdings, service.abort_all))
            await _first_of(stop, _done_event(drain))
            if not drain.done():  # a second signal: stop now
                drain.cancel()
                log.warning("stopping before the drain finished (%s)",
                            service.holdings().describe())
    finally:
        t0 = time.monotonic()
        health_servicer.stopping()  # NOT_SERVING, and the gateway's health watches end
        await server.stop(grace=2.0)
        t1 = time.monotonic()
        loop_stop.set()
        if thread is not None:
            thread.join(timeout=10)
        t2 = time.monotonic()
        if roles is not None:
            roles.close()
        t3 = time.monotonic()
        if engine is not None:
            engine.close()  # multi-rank worker: stop the other ranks
        log.info("stopped in %.2f s (server %.2f s, engine loop %.2f s, transfer %.2f s)",
                 time.monotonic() - t0, t1 - t0, t2 - t1, t3 - t2)
    if crashed:
        raise RuntimeError("the engine loop died (see the log above)") from crashed[0]


def _done_event(task: asyncio.Future[Any]) -> asyncio.Event:
    done = asyncio.Event()
    task.add_done_callback(lambda _: done.set())
    return done


def attach_role(engine: Engine, config: WorkerConfig, service: WorkerService) -> RoleHooks | None:
    """Give the engine its role's hooks (prefill ships rooms, decode lands them)."""
    if config.role == "both":
        return None
    return attach(engine, config, service.role_info)


def configure_logging(role: str) -> None:
    """The worker's log: INFO and up, one line per event. httpx logs every request it makes
    at INFO; a worker's only ones are its join's (POST /workers every 5 s while it serves,
    orchestrator/launch/join.py, which logs a change of answer itself)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_worker(config: WorkerConfig, on_drain: Callable[[], None] | None = None) -> None:
    """Blocking entry point of `tandem worker`: serve until drained (SIGTERM/SIGINT or Drain).

    A second signal while draining stops at once. `on_drain` runs (on the event loop) when the
    drain starts. Raises BindError when the port is taken.
    """
    configure_logging(config.role)

    async def main() -> None:
        stop = asyncio.Event()
        drainer = Drainer(config.drain_timeout_s, on_start=on_drain)
        loop = asyncio.get_running_loop()

        def on_signal(name: str) -> None:
            if drainer.draining:
                log.warning("%s while draining: stopping now", name)
                stop.set()
            else:
                drainer.request(name)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        await serve(config, stop, drainer)

    asyncio.run(main())
