"""The body of a generation request: read, parse, validate; each failure a clear 4xx.

`read_body` caps the size while reading (413), bounds the wait for the whole body (408),
bounds the bytes of all bodies being read at once (`BodyBudget`, 503) and refuses a
Content-Encoding (415: bodies are read as they come, uncompressed JSON);
`parse_request` turns the JSON into the endpoint's pydantic model, with malformed JSON, lone
surrogates and wrong types as 400s that name the field (OpenAI's words for an unknown one).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from gateway.errors import (
    ApiError,
    BadRequest,
    BodyBufferFull,
    PayloadTooLarge,
    RequestTimeout,
)
from gateway.http_protocol import body_arrived
from gateway.stalls import _timeout

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # cheap pre-check before the exact one


class BodyBudget:
    """Bytes of the request bodies being read at once, over all connections (one a gateway).
    Without it, clients that send most of a body and stall held max_connections x
    max_request_bytes until their body deadline."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise BodyBufferFull(f"the gateway is reading {self.limit} bytes of request "
                                 "bodies (gateway.max_body_buffer_bytes); retry shortly",
                                 code="body_buffer_full", retry_after_s=1)
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


async def read_body(request: Request, limit: int, timeout_s: float = 30.0,
                    budget: BodyBudget | None = None) -> bytes:
    """The request body, refused with 413 past `limit` bytes (checked while reading), with
    408 when it has not fully arrived after `timeout_s` (slow-loris clients hold no slot) and
    with 503 when the bodies being read would pass `budget`.
    A body the server already holds whole (the usual case: it came with the headers) is taken
    without arming the deadline, which costs ~9 us a request on the dev box."""
    encoding = raw_header(request, b"content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        # read as it came, a compressed body was a 400 "not valid JSON: 'utf-8' codec can't
        # decode byte 0x8b"; a body in any other encoding would be misread the same way
        raise ApiError(f"Content-Encoding {encoding!r} is not supported; send the body "
                       "uncompressed", status=415, type="invalid_request_error",
                       code="unsupported_content_encoding")
    declared = raw_header(request, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit} "
                              "(gateway.max_request_bytes)")
    if body_arrived(request.receive):
        message = await request.receive()  # returns at once: nothing to wait for
        if message["type"] != "http.request":
            raise ClientDisconnect()
        body: bytes = message.get("body", b"")
        if len(body) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes "
                                  "(gateway.max_request_bytes)")
        return body
    parts: list[bytes] = []
    size = held = 0
    try:
        async with _timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes "
                                          "(gateway.max_request_bytes)")
                if budget is not None:
                    budget.take(len(chunk))
                    held += len(chunk)
                parts.append(chunk)
    except (TimeoutError, asyncio.TimeoutError):  # the same class from 3.11 on
        raise RequestTimeout(f"request body incomplete after {timeout_s}s ({size} bytes arrived; "
                             "gateway.body_timeout_s); send the whole body at once",
                             code="body_timeout") from None
    finally:
        if budget is not None:  # read (or refused): parsing is quick, the wait is what counts
            budget.give(held)
    return b"".join(parts)


def raw_header(request: Request, name: bytes) -> str | None:
    """A header read off the raw ASGI headers (no Headers mapping built); `name` lower-case,
    as ASGI servers give header names."""
    for key, value in request.scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def parse_request(body: bytes, cls: type[BaseModel]) -> Any:
    """JSON → pydantic request; malformed JSON and wrong types are 400s naming the field."""
    try:
        obj = orjson.loads(body)  # the fast path; anything it refuses gets the exact answer below
    except orjson.JSONDecodeError:
        obj = _stdlib_loads(body)
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return _validate(body, obj, cls)


def _stdlib_loads(body: bytes) -> Any:
    """What orjson refuses (bad JSON, integers past 64 bits, lone surrogates, deep nesting):
    json's parse, and its errors as the 400 the client gets."""
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # thousands of nested arrays: no request of ours nests like that
        raise BadRequest("request body nests too deeply", code="invalid_json") from None


def _validate(body: bytes, obj: dict[str, Any], cls: type[BaseModel]) -> Any:
    if _SURROGATE_ESCAPE.search(body):  # JSON may escape a lone UTF-16 surrogate: untokenizable
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise BadRequest("request body holds a lone UTF-16 surrogate escape "
                             "(\\ud800-\\udfff); send valid Unicode text",
                             code="invalid_unicode") from None
    try:
        # strict: a value of the wrong type is a 400, as OpenAI answers ("stream": "yes" or
        # "max_tokens": "5" converted would guess); an integer is still a number.
        return cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except RecursionError:
        raise BadRequest("request body nests too deeply", code="invalid_json") from None


def validation_error(errors: Any) -> BadRequest:
    first = _union_error(errors) if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        top = len(loc) == 1
        msg = (f"Unrecognized request argument supplied: {where}" if top else
               f"{where}: unrecognized field; remove it")
        return BadRequest(msg, param=loc[0] if loc else None, code="unknown_parameter")
    return BadRequest(f"{where}: {first.get('msg', 'invalid value')}",
                      param=loc[0] if loc else None, code="invalid_value")


# A union's member tags in an error's loc, and the JSON kind each member takes.
_TAG_KINDS = {"str": "string", "int": "number", "float": "number", "bool": "boolean"}
_KIND_WORDS = {"string": "a string", "number": "a number", "boolean": "a boolean",
               "array": "an array", "object": "an object", "null": "null"}


def _tag_kind(part: Any) -> str | None:
    """The JSON kind a union member's tag takes (None: `part` is a field name or an index)."""
    if not isinstance(part, str):
        return None
    if part in _TAG_KINDS:
        return _TAG_KINDS[part]
    if part.startswith("literal["):
        return "string"
    if part.startswith("list["):
        return "array"
    if part.startswith("dict[") or part[:1].isupper():  # a mapping, or a model by class name
        return "object"
    return None


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "null"


def _shape(tag: str) -> str:
    if tag.startswith("list["):
        inner = _shape(tag[5:-1])
        return "a list of " + ("lists" + inner[6:] if inner.startswith("a list") else
                               {"a string": "strings", "an integer": "integers"}.get(
                                   inner, "objects"))
    if tag == "int":
        return "an integer"
    if tag.startswith("literal["):
        return "one of " + tag[8:-1].replace(",", ", ")
    return _KIND_WORDS[_TAG_KINDS.get(tag, "object")]


def _union_error(errors: Any) -> dict[str, Any]:
    """The error to report. A union field's errors come one per member, each tagged in its loc
    (`stop.str`, `tool_choice.literal[...]`): report the member of the JSON kind the client
    sent, without its tag, or else the shapes the field takes."""
    first: dict[str, Any] = errors[0]
    loc = list(first.get("loc", ()))
    at = next((i for i, p in enumerate(loc) if _tag_kind(p) is not None), None)
    if at is None:
        return first
    prefix = loc[:at]
    members = [e for e in errors if list(e.get("loc", ()))[:at] == prefix
               and len(e["loc"]) > at and _tag_kind(e["loc"][at]) is not None]
    # An error right at the member's tag holds the field's value; a deeper one holds a part.
    sent = next((_json_kind(e.get("input")) for e in members if len(e["loc"]) == at + 1),
                "object")
    same = [e for e in members if _tag_kind(e["loc"][at]) == sent]
    if same:  # the member that got furthest into the value is the one the client meant
        e = max(same, key=lambda e: len(e["loc"]))
        return {**e, "loc": (*prefix, *e["loc"][at + 1:])}
    shapes = list(dict.fromkeys(_shape(str(e["loc"][at])) for e in members))
    listed = ", ".join(shapes[:-1]) + " or " + shapes[-1] if len(shapes) > 1 else shapes[0]
    return {"loc": tuple(prefix), "type": "union",
            "msg": f"expected {listed}, got {_KIND_WORDS[sent]}"}
