"""Typed gateway errors and their OpenAI-shaped HTTP form.

Everything that can go wrong on a request is raised as an `ApiError` (or a subclass) inside
the gateway and turned into `{"error": {"message", "type", "code", "param"}}` with a real
status code (and `headers`, e.g. Retry-After on a 429) at the HTTP edge. Worker failures
arrive as gRPC status codes and are mapped here too, so the mapping lives in one place,
together with whom a failure blames (`WorkerCallError.blamed_url`).
"""

from __future__ import annotations

import json
import logging

import grpc
from starlette.responses import Response

from protocol.errors import ERROR_CODE_KEY, PEER_TIMEOUT, REQUEST_TIMEOUT


class ApiError(Exception):
    """An error that reaches the client as an OpenAI-shaped body with `status`."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None, type: str | None = None,
                 retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.code = code
        self.param = param
        # Seconds a client should wait before trying again (429 / 503): Retry-After.
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)} if self.retry_after_s else {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    @property
    def outcome(self) -> str:
        """The request's outcome label in the metrics: refused for load (429, a full queue or
        a worker out of room: retry later), the client's mistake (4xx), or ours (5xx)."""
        if self.status == 429:
            return "rejected"
        return "client_error" if self.status < 500 else "server_error"

    @property
    def log_level(self) -> int:
        """The gateway's or a worker's failure (5xx) at WARNING, for operators; the client's
        own mistake (4xx) at DEBUG, not to flood the log with other people's typos."""
        return logging.WARNING if self.status >= 500 else logging.DEBUG

    def response(self, headers: dict[str, str]) -> Response:
        """The error as the request's whole HTTP answer, with the request's `headers`."""
        return Response(self.json_bytes(), status_code=self.status,
                        media_type="application/json", headers={**headers, **self.headers})


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"


class RequestTimeout(ApiError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class NoHealthyWorker(ApiError):
    status = 503
    type = "service_unavailable"


class BodyBufferFull(ApiError):
    """The bodies being read at once would pass `gateway.max_body_buffer_bytes` (503). The
    connection closes: the rest of a refused body is not worth reading."""

    status = 503
    type = "service_unavailable"

    @property
    def headers(self) -> dict[str, str]:
        return {**super().headers, "connection": "close"}


class QueueFull(ApiError):
    """The gateway's queue of requests waiting for a decode seat is full (429)."""

    status = 429
    type = "rate_limit_error"


class QueueTimeout(ApiError):
    """A request waited `gateway.queue_timeout_s` for a decode seat and got none (503)."""

    status = 503
    type = "service_unavailable"


class WorkerCallError(ApiError):
    """A worker's Generate call failed; `code` keeps the gRPC status for retry decisions.

    `blamed_url` / `blamed_pool`: the worker the failure is charged to (a retry avoids it, and
    /metrics counts it there). The leg's own worker, except for ABORTED on a PD leg: the room's
    other side failed it (the worker says so with that code), so the other leg's worker is.
    """

    def __init__(self, grpc_code: grpc.StatusCode, details: str, worker_url: str, leg: str) -> None:
        status, etype = _GRPC_TO_HTTP.get(grpc_code, (502, "server_error"))
        # The client's own mistake reads as the worker's words alone; a failure of ours names
        # the leg and the worker (operators read those).
        message = details if grpc_code in _CLIENT_FAULTS else \
            f"{leg} worker {worker_url}: {grpc_code.name}: {details}"
        super().__init__(message, status=status, code=grpc_code.name.lower(), type=etype,
                         retry_after_s=1 if status == 429 else 0)
        self.grpc_code = grpc_code
        self.details = details
        self.worker_url = worker_url
        self.leg = leg
        self.blamed_url = worker_url
        self.blamed_pool = "workers" if leg == "mono" else leg
        # The worker says the room's other side stopped answering (trailing metadata
        # tandem-error-code: peer_timeout): the gateway marks that worker suspect too.
        self.peer_timeout = False
        # The gateway's request_timeout_s ended the leg (tandem-error-code: request_timeout).
        self.request_timeout = False

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError, worker_url: str, leg: str) -> WorkerCallError:
        """A failed leg's error, with the error class its trailing metadata carries."""
        err = cls(exc.code(), exc.details() or "", worker_url, leg)
        codes = {v for k, v in exc.trailing_metadata() or () if k == ERROR_CODE_KEY}
        err.peer_timeout = PEER_TIMEOUT in codes
        err.request_timeout = REQUEST_TIMEOUT in codes
        return err

    @property
    def peer_fault(self) -> bool:
        """The worker reports that the other side of its PD room failed it."""
        return self.grpc_code == grpc.StatusCode.ABORTED and self.leg in ("prefill", "decode")

    @property
    def worker_fault(self) -> bool:
        """True when a retry on another worker may succeed (never for the client's own errors,
        nor for the request's own time running out)."""
        return self.grpc_code in RETRYABLE and not self.request_timeout


def refused_constraint(err: ApiError, source: str) -> ApiError:
    """A worker's refusal of the request's output constraint (its grammar does not compile),
    named as the client sent it: the worker names the wire field (sampling.structured...) that
    the gateway built from a request field (`source`: response_format, guided_regex, ...)."""
    if not (source and isinstance(err, WorkerCallError)
            and err.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
            and err.details.startswith("sampling.structured")):
        return err
    why = err.details.partition(": ")[2] or err.details
    return BadRequest(f"{source}: {why}", param=source, code="invalid_grammar")


# The worker's error vocabulary (protocol/tandem.proto) → HTTP status and OpenAI error type.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.ABORTED: (502, "bad_gateway"),  # a PD room failed on the other worker's side
    grpc.StatusCode.INTERNAL: (502, "server_error"),
}

_CLIENT_FAULTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED})
