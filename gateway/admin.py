"""Admin routes: the worker pools at run time, and the admin key that guards them.

    GET    /workers          every worker: identity, state (starting | serving | draining |
                             refused | dead), load, in-flight requests
    POST   /workers          {"url": "host:port", "role": "prefill|decode|both"}: add a worker
                             once its GetInfo matches this cluster (201; 200 when that url is
                             listed already and matches: a retry, or a restart on it; 409
                             when refused)
    DELETE /workers/{url}    stop routing to it now, drain it, then drop it (202)
    GET    /metrics          Prometheus text

The admin key is separate from the API key: `Authorization: Bearer <admin key>`. Without a
header the answer is 401; with any other key (the API key included) 403. With no admin key
configured, POST and DELETE are off (403, saying how to turn them on), and GET /workers and
/metrics stay open only while no API key is set either (`metrics_public` opens /metrics for
scrapers in every case).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.config import GatewayConfig
from gateway.errors import ApiError, BadRequest, NotFound, Unauthorized
from gateway.pool import WorkerPool
from gateway.workers import IdentityRefused, WorkerUnreachable

_JSON = "application/json"
_MAX_BODY = 64 * 1024


class Forbidden(ApiError):
    status = 403
    type = "permission_error"


class AddWorker(BaseModel):
    """The body of POST /workers; unknown fields are refused (400), never ignored."""

    model_config = ConfigDict(extra="forbid")
    url: str  # host:port of the worker's gRPC server, as GET /workers shows it
    role: Literal["prefill", "decode", "both"]


class AdminAuth:
    """Who may read and change the pools."""

    def __init__(self, config: GatewayConfig) -> None:
        self._admin = config.admin_key.encode()
        self._api = config.api_key.encode()  # b"": no API key
        self._metrics_public = config.metrics_public

    def check(self, request: Request, *, change: bool = False, metrics: bool = False) -> None:
        """Raise 401/403 unless the request may use this admin route."""
        if metrics and self._metrics_public:
            return
        if not self._admin:
            if change:
                raise Forbidden(
                    "admin routes are off: start the gateway with --admin-key KEY "
                    "(gateway.admin_key) and send `Authorization: Bearer KEY`",
                    code="admin_disabled",
                )
            if self._api:
                what = "/metrics" if metrics else "/workers"
                raise Forbidden(
                    f"{what} needs the admin key while an API key is set: start the "
                    "gateway with --admin-key KEY"
                    + (" (or gateway.metrics_public: true)" if metrics else ""),
                    code="admin_disabled",
                )
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized(
                "this route needs the admin key: send `Authorization: Bearer <admin key>`",
                code="missing_admin_key",
            )
        sent = token.strip().encode()
        if not hmac.compare_digest(sent, self._admin):
            api = bool(self._api) and hmac.compare_digest(sent, self._api)
            raise Forbidden(
                "wrong key for an admin route: "
                + ("the API key is not the admin key" if api
                   else "send the gateway's --admin-key (gateway.admin_key)"),
                code="invalid_admin_key",
            )


def _json(body: object, status: int = 200) -> Response:
    return Response(json.dumps(body).encode(), status_code=status, media_type=_JSON)


# A DNS name (underscores allowed: container and compose service names carry them; a final
# dot: a fully qualified name).
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")


def check_url(url: str) -> str:
    """`host:port` as gRPC dials it: a host name, an IPv4 address or a bracketed IPv6 one,
    and a port within 1..65535. Anything else is a BadRequest naming the part at fault (gRPC
    would read a scheme, a query or an unbracketed IPv6 address its own way)."""
    host, sep, port = url.rpartition(":")
    problem = ""
    if "/" in url or not sep or not host:
        problem = "give the worker's gRPC address as host:port"
    elif not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        problem = "the port must be a number within 1..65535"
    elif not _host_ok(host):
        problem = "the host must be a host name, an IPv4 address or an [IPv6] one in brackets"
    if problem:
        raise BadRequest(
            f"url {url!r}: {problem} (as GET /workers shows a worker: 127.0.0.1:8101)",
            param="url",
            code="invalid_value",
        )
    return url


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return host.isascii() and _HOSTNAME.fullmatch(host) is not None


async def list_workers(auth: AdminAuth, pool: WorkerPool | None, request: Request) -> Response:
    auth.check(request)
    return _json([w.as_json() for w in (pool.all() if pool else [])])


async def add_worker(auth: AdminAuth, pool: WorkerPool | None, request: Request) -> Response:
    auth.check(request, change=True)
    if pool is None:
        raise ApiError(
            "the gateway is starting; retry shortly", status=503, type="service_unavailable"
        )
    raw = await request.body()
    if len(raw) > _MAX_BODY:
        raise BadRequest(f"body over {_MAX_BODY} bytes", code="invalid_value")
    try:
        body = AddWorker.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise BadRequest(
            f"{where}: {first.get('msg', 'invalid value')} (POST /workers takes "
            '{"url": "host:port", "role": "prefill|decode|both"})',
            param=where,
            code="invalid_value",
        ) from None
    url = check_url(body.url)
    try:
        w, added = await pool.add(url, body.role)
    except ValueError as exc:
        raise ApiError(
            str(exc), status=409, type="invalid_request_error", code="worker_conflict"
        ) from None
    except IdentityRefused as exc:
        raise ApiError(
            str(exc), status=409, type="invalid_request_error", code="identity_mismatch"
        ) from None
    except WorkerUnreachable as exc:
        raise ApiError(
            str(exc), status=502, type="bad_gateway", code="worker_unreachable"
        ) from None
    return _json(w.as_json(), status=201 if added else 200)


async def remove_worker(auth: AdminAuth, pool: WorkerPool | None, request: Request) -> Response:
    auth.check(request, change=True)
    url = request.path_params["url"]
    w = pool.find(url) if pool else None
    if pool is None or w is None:
        listed = ", ".join(x.url for x in pool.all()) if pool else ""
        raise NotFound(
            f"no worker {url!r} in the pools (GET /workers lists: {listed or 'none'})",
            code="worker_not_found",
        )
    pool.remove(w)
    return _json(w.as_json(), status=202)
