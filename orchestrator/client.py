"""The small OpenAI-API client shared by `tandem eval` and `tandem bench` (httpx, asyncio).

Speaks to any OpenAI-compatible server, ours or not: one shared `httpx.AsyncClient` per run
(connection reuse), bearer auth when an api key is given, the model name taken from
`GET /v1/models` when the user did not name one.
"""

from __future__ import annotations

from typing import Any

import httpx


class ServerError(RuntimeError):
    """The server is unreachable or answered something that is not the OpenAI API."""


def make_client(
    url: str, api_key: str = "", timeout_s: float = 600.0, concurrency: int = 64
) -> httpx.AsyncClient:
    """One AsyncClient for the whole run; the pool is sized so `concurrency` requests can fly."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(
        max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1)
    )
    return httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits
    )


def error_text(resp: httpx.Response) -> str:
    """`HTTP 503: message` from an OpenAI-shaped error body, or the raw body's start."""
    try:
        body: Any = resp.json()
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    return f"HTTP {resp.status_code}: {message}"


def key_hint(status: int, key_given: bool) -> str:
    """What to fix for a 401 (the flag), "" for any other status."""
    if status != 401:
        return ""
    return ("; the server wants an API key: pass --api-key KEY "
            f"(given: {'wrong' if key_given else 'none'})")


# GET /v1/models gives up after this (the completion gate's and the tool loop's first question):
# a frozen server is an error in seconds, not after the 600 s a request may take
MODELS_TIMEOUT_S = 10.0


async def first_model(client: httpx.AsyncClient, model: str = "") -> str:
    """The model to ask for: the first `GET /v1/models` lists, or `model` (`--model`) once the
    server lists it. Asked before any load even with `model` given, so that an unreachable server
    or a wrong key is one error, not one per request; a server without that route (404) is
    taken at its word for `model`."""
    try:
        resp = await client.get("/v1/models", timeout=MODELS_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ServerError(
            f"cannot reach {client.base_url}: {type(exc).__name__}: {exc}. Is the server running?"
        ) from None
    if model and resp.status_code == 404:
        return model
    base = str(client.base_url).rstrip("/")
    if resp.status_code != 200:
        raise ServerError(f"GET {base}/v1/models failed: {error_text(resp)}"
                          + key_hint(resp.status_code, "authorization" in client.headers))
    try:
        ids = [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        ids = []
    return pick_model(ids, model, base)


def pick_model(ids: list[str], model: str, url: str) -> str:
    """`model` if the server at `url` lists it, else the first it lists when none was asked for;
    ServerError naming the served ones otherwise."""
    if model and model in ids:
        return model
    if model and ids:
        served = ", ".join(repr(i) for i in ids[:10])
        raise ServerError(f"--model {model!r} is not served at {url}: it serves {served}; pass "
                          "one of them (or leave --model out for the first)")
    if ids:
        return ids[0]
    if model:  # an empty list: nothing to check against
        return model
    raise ServerError(f"GET {url}/v1/models returned no model; pass --model NAME")
