"""The gateway's HTTP app: `create_app(config)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models
and /v1/models/{model}, GET /health (200 when every pool has a healthy worker, else 503: ready
for traffic), GET /livez (200 while the process serves HTTP, workers or not: alive), and
behind the admin key (gateway/admin.py): GET /metrics (Prometheus), GET/POST /workers and
DELETE /workers/{url} (the pools at run time). A lifespan owns the worker pool (gRPC channels,
health and load tasks). Every error leaves as `{"error": {...}}` with a real status code.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway import admin
from gateway.agents import Parsers
from gateway.config import GatewayConfig, GatewayConfigError
from gateway.dispatcher import Dispatcher
from gateway.errors import ApiError, NoHealthyWorker, NotFound, Unauthorized
from gateway.metrics import Metrics
from gateway.openai_responses import ModelCard, ModelList
from gateway.parsers import (
    AUTO,
    NONE,
    detect_reasoning_parser,
    detect_tool_call_parser,
)
from gateway.pool import Worker, WorkerPool
from gateway.request_body import BodyBudget, validation_error
from gateway.routing import CacheAware, LeastLoad, Policy, RoundRobin
from gateway.sampling_defaults import describe, load_sampling_defaults
from gateway.serving import GenerationHandler
from gateway.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)
_JSON = "application/json"


def make_policy(name: str, config: GatewayConfig, page_size: int) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    return CacheAware(
        page_size=page_size,
        max_pages=config.cache_aware_max_pages,
        load_threshold=config.cache_aware_load_threshold,
    )


def resolve_parsers(config: GatewayConfig, tokenizer: Tokenizer) -> Parsers:
    """The configured parsers, "auto" resolved against the chat template, "none" as ""."""
    template = tokenizer.template_source

    def pick(value: str, detect: str) -> str:
        return detect if value == AUTO else "" if value == NONE else value

    return Parsers(reasoning=pick(config.reasoning_parser, detect_reasoning_parser(template)),
                   tool_call=pick(config.tool_call_parser, detect_tool_call_parser(template)))


class Gateway:
    """What the routes need; built by `create_app`, filled in by the lifespan."""

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.parsers = resolve_parsers(config, tokenizer)
        log.info("gateway: reasoning parser %s, tool-call parser %s",
                 self.parsers.reasoning or "none", self.parsers.tool_call or "none")
        self.sampling_defaults = load_sampling_defaults(config.model_path,
                                                        config.generation_config)
        if config.generation_config == AUTO:
            log.info("gateway: sampling defaults from generation_config.json: %s (a request's "
                     "own fields win; gateway.generation_config: none ignores the file)",
                     describe(self.sampling_defaults))
        self.metrics = Metrics()
        self.pool: WorkerPool | None = None
        self._handler: GenerationHandler | None = None
        self._handler_version = -1  # the pool.version it was built at
        self._dispatcher: Dispatcher | None = None
        self.created = int(time.time())
        self._key = config.api_key.encode()
        self._stop = asyncio.Event()  # a stop signal came: the start-up wait ends at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self.body_budget = BodyBudget(config.max_body_buffer_bytes)

    def stop_asked(self) -> None:
        """A stop signal (gateway/server.py): a start-up wait for workers ends now. Called
        from the signal handler, so the event is set on the loop's own turn."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def start(self) -> None:
        cfg = self.config
        pool = self.pool = WorkerPool(cfg)
        pool.on_load(self._on_load)
        pool.on_remove(self._on_remove)
        self._loop = asyncio.get_running_loop()
        await pool.start()
        if cfg.startup_wait_s > 0 and not await self._wait_ready(pool, cfg.startup_wait_s):
            if self._stop.is_set():
                return  # the server stops next: no warning, no dispatcher
            log.warning(
                "gateway: not every pool has a healthy worker after %.0f s; serving anyway "
                "(/health answers 503 until one is)",
                cfg.startup_wait_s,
            )
        policies: dict[str, Policy] = {}
        for name in pool.pools:
            policy_name = cfg.prefill_policy if name == "prefill" else cfg.decode_policy
            if name == "workers":  # mono: the prefill policy decides, it sees the prompt
                policy_name = cfg.prefill_policy
            policies[name] = make_policy(policy_name, cfg, self._page_size())
        self._dispatcher = Dispatcher(cfg, pool, policies, self.metrics)

    async def _wait_ready(self, pool: WorkerPool, timeout_s: float) -> bool:
        """The pool's readiness, or False at once when a stop signal comes first."""
        ready = asyncio.ensure_future(pool.wait_ready(timeout_s))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((ready, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:  # either way (a cancelled start too), nothing is left waiting
            stop.cancel()
            if not ready.done():
                ready.cancel()  # the stop came first
        return ready.done() and not ready.cancelled() and ready.result()

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def _page_size(self) -> int:
        assert self.pool is not None
        return next((i.page_size for i in self.pool.infos() if i.page_size > 0), 16)

    def handler(self) -> GenerationHandler:
        """The generation handler; built once the workers' info (name, limits) is known."""
        # Rebuilt when a worker joins, leaves or restarts (pool.version): the limits are the
        # current workers' (read once, a joined worker with a smaller pool got longer prompts).
        if self._handler is not None and self.pool is not None and (
                self._handler_version == self.pool.version):
            return self._handler
        if self.pool is None or self._dispatcher is None:
            raise NoHealthyWorker("the gateway is starting; retry shortly")
        version, infos = self.pool.version, self.pool.infos()
        if len(infos) < len(self.pool.all()):
            # Limits are the minimum over all workers; until each answered GetInfo use what is
            # known, but do not cache it.
            if not infos:
                raise NoHealthyWorker(
                    "no worker has answered yet; retry shortly", code="no_healthy_worker"
                )
            return self._build_handler(infos)
        self._handler, self._handler_version = self._build_handler(infos), version
        return self._handler

    def _build_handler(self, infos: list[Any]) -> GenerationHandler:
        assert self._dispatcher is not None
        lens = [i.max_model_len for i in infos if i.max_model_len > 0]
        vocab = [i.vocab_size for i in infos if i.vocab_size > 0]
        return GenerationHandler(
            self.tokenizer,
            self._dispatcher,
            self.metrics,
            self.model_name(),
            max_model_len=min(lens, default=0),
            vocab_size=min(vocab, default=self.tokenizer.vocab_size),
            max_request_bytes=self.config.max_request_bytes,
            body_timeout_s=self.config.body_timeout_s,
            parsers=self.parsers,
            sampling_defaults=self.sampling_defaults,
            eos_token_ids=frozenset(e for i in infos for e in i.eos_token_ids),
            body_budget=self.body_budget,
        )

    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.pool is not None:
            for info in self.pool.infos():
                if info.model:
                    return info.model
        return os.path.basename(os.path.normpath(self.config.model_path))

    def check_auth(self, request: Request) -> None:
        if not self._key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise Unauthorized(
                "missing or wrong API key; send `Authorization: Bearer <key>`",
                code="invalid_api_key",
            )

    def _on_load(self, w: Worker) -> None:
        self.metrics.observe_load(w.pool, w.url, w.load, w.healthy)

    def _on_remove(self, w: Worker) -> None:
        """A removed worker's series leave /metrics with it."""
        self.metrics.remove_worker(w.pool, w.url)


def _error_response(err: ApiError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, media_type=_JSON)


Endpoint = Callable[[Request], Awaitable[Response]]


class _GatewayApp(FastAPI):
    """FastAPI, except that POST to a generation route goes straight to its endpoint.

    Below Starlette's stack (error middleware, exception middleware, exit stack, body limit,
    router, route wrapper) every streamed event would pass through six `send` wrappers; here
    it passes through none, with the same error mapping (ApiError as itself, anything else a
    logged 500). Everything else, including those paths with another method (405), takes the
    full stack.
    """

    def __init__(self, fast: dict[str, Endpoint], **kw: Any) -> None:
        super().__init__(**kw)
        self._fast = fast

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._fast.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive))
        except ApiError as exc:
            response = _error_response(exc)
        except Exception:
            log.exception("unexpected error on %s", scope["path"])
            response = _error_response(ApiError("internal gateway error; see the gateway log"))
        await response(scope, receive, send)


def create_app(config: GatewayConfig) -> FastAPI:
    """Build the gateway app. The tokenizer loads now (fail fast); workers connect in the
    lifespan."""
    config.validate()
    if not config.model_path:
        raise GatewayConfigError(
            "gateway.model_path: set it to the model directory that holds tokenizer.json"
        )
    gw = Gateway(config, load_tokenizer(config.model_path))  # token-id mode without one

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    # The routes are plain Starlette routes: FastAPI's dependency solving and response
    # validation cost ~15% of a request here and buy nothing (bodies are validated by hand so
    # that every error is OpenAI-shaped).
    async def generate(request: Request, chat: bool) -> Response:
        try:
            gw.check_auth(request)
            handler = gw.handler()
        except ApiError as err:  # refused before the handler: a finished request all the same
            gw.metrics.requests.labels(err.outcome).inc()
            raise
        return await handler.handle(request, chat=chat)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    app = _GatewayApp({"/v1/completions": completions, "/v1/chat/completions": chat_completions},
                      lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(validation_error(exc.errors()))  # OpenAI says 400, not FastAPI's 422

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception(
            "unexpected error on %s", request.url.path
        )  # a bug: say so loudly, answer 500
        return _error_response(ApiError("internal gateway error; see the gateway log"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        etype = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if exc.status_code == 404:  # OpenAI's words, and what is served (no /v1/responses)
            message = (f"Invalid URL ({request.method} {request.url.path}): this gateway "
                       "serves POST /v1/chat/completions and /v1/completions, GET /v1/models")
        allow = (exc.headers or {}).get("Allow")
        if exc.status_code == 405 and allow:  # the methods the route takes, in the header too
            message = f"{request.method} {request.url.path} is not allowed; use {allow}"
        response = _error_response(ApiError(message, status=exc.status_code, type=etype))
        response.headers.update(exc.headers or {})
        return response

    def model_card() -> ModelCard:
        lens = [
            i.max_model_len for i in (gw.pool.infos() if gw.pool else []) if i.max_model_len > 0
        ]
        return ModelCard(id=gw.model_name(), created=gw.created, max_model_len=min(lens, default=0))

    async def models(request: Request) -> Response:
        gw.check_auth(request)
        body = ModelList(data=[model_card()])
        return Response(body.model_dump_json().encode(), media_type=_JSON)

    async def model(request: Request) -> Response:  # the openai client's models.retrieve
        gw.check_auth(request)
        name = request.path_params["model"]
        if name != gw.model_name():
            raise NotFound(f"model {name!r} does not exist; this gateway serves "
                           f"{gw.model_name()!r}", code="model_not_found", param="model")
        return Response(model_card().model_dump_json().encode(), media_type=_JSON)

    async def health(request: Request) -> Response:
        pool = gw.pool
        ready = pool is not None and pool.ready()
        pools = (
            {name: sum(w.healthy for w in ws) for name, ws in pool.pools.items()} if pool else {}
        )
        body = {"status": "ok" if ready else "unavailable", "healthy_workers": pools}
        return Response(
            json.dumps(body).encode(), status_code=200 if ready else 503, media_type=_JSON
        )

    async def livez(request: Request) -> Response:
        return Response(b'{"status":"alive"}', media_type=_JSON)

    auth = admin.AdminAuth(config)

    async def workers(request: Request) -> Response:
        # One route for both methods: as two, a 405 named only the first one's (GET, HEAD).
        if request.method == "POST":
            return await admin.add_worker(auth, gw.pool, request)
        return await admin.list_workers(auth, gw.pool, request)

    async def remove_worker(request: Request) -> Response:
        return await admin.remove_worker(auth, gw.pool, request)

    async def metrics(request: Request) -> Response:
        auth.check(request, metrics=True)
        m = gw.metrics
        if gw.pool is not None:
            for name, ws in gw.pool.pools.items():
                m.pool_running.labels(name).set(sum(w.load.running for w in ws))
                m.pool_waiting.labels(name).set(sum(w.load.waiting for w in ws))
                for w in ws:
                    m.worker_healthy.labels(w.pool, w.url).set(1 if w.healthy else 0)
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/models/{model:path}", model, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/livez", livez, methods=["GET"])
    app.add_route("/workers", workers, methods=["GET", "POST"])
    app.add_route("/workers/{url:path}", remove_worker, methods=["DELETE"])
    app.add_route("/metrics", metrics, methods=["GET"])
    return app
