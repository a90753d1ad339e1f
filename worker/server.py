"""The worker process: the gRPC Worker service and grpc.health.v1 in front of the engine.

Start-up order: load weights → register services → bind the port (health NOT_SERVING) →
warm-up step → SERVING.
The engine runs on its own thread; the asyncio loop here only moves messages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import signal
import threading
from collections import defaultdict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc, tls
from worker.config import WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.roles import attach
from worker.sampling import SamplingParams, SamplingParamsError
from worker.scheduler import RoleHooks

log = logging.getLogger("tandem.worker")

STATUS_BY_ERROR = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "resource": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "peer": grpc.StatusCode.ABORTED,  # the room's other side failed it: retry elsewhere, not our fault
    "peer_timeout": grpc.StatusCode.ABORTED,  # ... because it stopped answering in time
    "internal": grpc.StatusCode.INTERNAL,
}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ERROR_CODE_KEY = "tandem-error-code"  # trailing metadata of a failed Generate: the error class


class InvalidRequest(ValueError):
    """The request is the client's mistake (maps to INVALID_ARGUMENT)."""


class WorkerService(tandem_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine: Engine | None = None  # set once weights are loaded
        self.role_info: dict[str, str] = {}  # bootstrap_addr, transfer_backend (PD roles)
        self.epoch = secrets.randbits(64) or 1  # this incarnation; PD roles use the transfer manager's
        self._ids = itertools.count()
        self._by_external: dict[str, set[str]] = defaultdict(set)  # gateway request id -> ours
        self._by_room: dict[int, str] = {}

    # ---- Generate ------------------------------------------------------------------------------
    async def Generate(self, request: tandem_pb2.GenerateRequest, context: grpc.aio.ServicerContext):  # type: ignore[override]
        engine = self._ready_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is starting up")
            return
        try:
            req = self._make_request(engine, request)
        except (InvalidRequest, SamplingParamsError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if sum(s.stats().waiting for s in engine.schedulers) >= self.config.scheduler.max_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker queue is full; retry later")
            return
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        # Keyed by the attempt: an Abort for one attempt must not end a retry on this worker.
        external = request.attempt_id or request.request_id
        self._by_external[external].add(req.request_id)
        if req.room:
            self._by_room[req.room] = req.request_id
        log.debug("request %s (%s): %d prompt tokens", external, req.request_id, req.num_prompt_tokens)
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
            ids = self._by_external.get(external)
            if ids is not None:
                ids.discard(req.request_id)
                if not ids:
                    del self._by_external[external]
            if req.room:
                self._by_room.pop(req.room, None)

    def _make_request(self, engine: Engine, message: tandem_pb2.GenerateRequest) -> Request:
        prompt = list(message.prompt_token_ids)
        if not prompt:
            raise InvalidRequest("prompt_token_ids is empty: send at least one token")
        vocab = engine.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        sampling = sampling_from_message(message.sampling)
        if len(prompt) + sampling.max_tokens > engine.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context length {engine.max_model_len}; shorten the prompt or lower max_tokens"
            )
        role = self.config.role
        has_room = message.HasField("disagg") and message.disagg.room != 0
        if role != "both" and not has_room:
            raise InvalidRequest(f"this is a {role} worker: requests need disagg.room and disagg.bootstrap_addr")
        rid = f"{message.request_id or 'req'}#{next(self._ids)}"
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            room=message.disagg.room if has_room else 0,
            bootstrap_addr=message.disagg.bootstrap_addr if has_room else "",
        )

    # ---- the other calls -------------------------------------------------------------------------
    async def Abort(self, request: tandem_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> tandem_pb2.AbortResponse:  # type: ignore[override]
        engine = self._ready_engine()
        ids = set(self._by_external.get(request.attempt_id or request.request_id, ()))
        if request.room and request.room in self._by_room:
            ids.add(self._by_room[request.room])
        if engine is not None:
            for rid in ids:
                engine.abort(rid, "aborted")
        return tandem_pb2.AbortResponse(found=bool(ids))

    async def GetLoad(self, request: tandem_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> tandem_pb2.Load:  # type: ignore[override]
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
        if engine.hooks is not None:
            rooms, total_bytes, total_pages, waiting = engine.hooks.load_stats()
            load.rooms.update(rooms)
            load.transfer_bytes = total_bytes
            load.transfer_pages = total_pages
            load.waiting += waiting
        return load

    async def GetInfo(self, request: tandem_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> tandem_pb2.WorkerInfo:  # type: ignore[override]
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


async def serve(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Serve until `stop` is set. Health turns SERVING after load + warm-up."""
    config.validate()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    service = WorkerService(config)
    tandem_pb2_grpc.add_WorkerServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Weights load before the port opens: a worker that answers is a worker with a model.
    loop = asyncio.get_running_loop()
    log.info("%s worker loading %s", config.role, config.model.path)
    engine = await loop.run_in_executor(None, Engine, config)
    roles = await loop.run_in_executor(None, attach_role, engine, config, service)
    address = f"{config.host}:{config.port}"
    if tls.add_port(server, address, config.tls) == 0:
        raise RuntimeError(f"cannot bind {address}: is the port in use? set the worker's port")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await loop.run_in_executor(None, engine.warm_up)
    if roles is not None:
        engine.set_hooks(roles)  # after warm-up: the warm-up request has no room
    loop_stop = threading.Event()
    crashed: list[BaseException] = []

    def run_engine() -> None:
        try:
            engine.run_forever(loop_stop)
        except BaseException as exc:  # a dead engine must not keep answering SERVING
            log.exception("engine loop died; shutting the worker down")
            crashed.append(exc)
            loop.call_soon_threadsafe(stop.set)

    thread = threading.Thread(target=run_engine, name="engine", daemon=True)
    thread.start()
    service.engine = engine
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("ready: %s worker on %s (%d KV pages of %d tokens per DP group, %d groups)",
             config.role, address, engine.kv.shape.num_pages, config.cache.page_size,
             len(engine.schedulers))
    try:
        await stop.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        loop_stop.set()
        thread.join(timeout=10)
        if roles is not None:
            roles.close()
        engine.close()  # multi-rank worker: stop the other ranks
    if crashed:
        raise RuntimeError("the engine loop died (see the log above)") from crashed[0]


def attach_role(engine: Engine, config: WorkerConfig, service: WorkerService) -> RoleHooks | None:
    """Give the engine its role's hooks (prefill ships rooms, decode lands them)."""
    if config.role == "both":
        return None
    return attach(engine, config, service.role_info)


def run_worker(config: WorkerConfig) -> None:
    """Blocking entry point of `tandem worker`: serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {config.role} %(levelname)s %(name)s: %(message)s")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(main())
