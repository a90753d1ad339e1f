"""Typed gateway errors and their OpenAI-shaped HTTP form.

Everything that can go wrong on a request is raised as an `ApiError` (or a subclass) inside
the gateway and turned into `{"error": {"message", "type", "code", "param"}}` with a real
status code at the HTTP edge. Worker failures arrive as gRPC status codes and are mapped
here too, so the mapping lives in one place.
"""

from __future__ import annotations

import json

import grpc


class ApiError(Exception):
    """An error that reaches the client as an OpenAI-shaped body with `status`."""

    status: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


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


class WorkerCallError(ApiError):
    """A worker's Generate call failed; `code` keeps the gRPC status for retry decisions."""

    def __init__(self, grpc_code: grpc.StatusCode, details: str, worker_url: str, leg: str) -> None:
        status, etype = _GRPC_TO_HTTP.get(grpc_code, (502, "server_error"))
        super().__init__(f"{leg} worker {worker_url}: {grpc_code.name}: {details}", status=status,
                         code=grpc_code.name.lower(), type=etype)
        self.grpc_code = grpc_code
        self.details = details
        self.worker_url = worker_url
        self.leg = leg

    @property
    def worker_fault(self) -> bool:
        """True when a retry on another worker may succeed (never for the client's own errors)."""
        return self.grpc_code in RETRYABLE


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

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.ABORTED})
