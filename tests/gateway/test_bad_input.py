"""The bad-input corpus, sent through a real gateway in front of a real 1P1D cluster.

Every entry must get a 4xx with an OpenAI-shaped error body (or, for entries a server may
accept, a 200) — never a 5xx, never a dropped connection, never a crashed process — and the
cluster must still serve and hold no pages afterwards. Slow-loris clients get a bounded wait.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
NAME = MODEL.name
BODY_TIMEOUT_S = 2.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        "configs/tiny-1p1d.yaml",
        f"gateway.body_timeout_s={BODY_TIMEOUT_S}",
        tmp=tmp_path_factory.mktemp("badinput"),
        model=MODEL,
    ) as c:
        yield c


def ok_completion(**kw: object) -> dict[str, object]:
    return {"model": NAME, "prompt": "a=1;\na?", "max_tokens": 2, **kw}


def ok_chat(**kw: object) -> dict[str, object]:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": "a=1;\na?"}],
        "max_tokens": 2,
        **kw,
    }


# (id, path, raw body bytes); all of these must be refused with a 4xx.
RAW_4XX: list[tuple[str, str, bytes]] = [
    ("empty-body", "/v1/completions", b""),
    ("truncated-json", "/v1/completions", b'{"model": "x", "prompt": "a'),
    ("malformed-json", "/v1/completions", b"{prompt: 'a'}"),
    ("json-array", "/v1/completions", b"[1, 2, 3]"),
    ("json-string", "/v1/chat/completions", b'"hello"'),
    ("json-null", "/v1/chat/completions", b"null"),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}'),
    (
        "nan-literal-temperature",
        "/v1/completions",
        json.dumps(ok_completion(temperature=float("nan"))).encode(),
    ),
    (
        "inf-literal-temperature",
        "/v1/completions",
        json.dumps(ok_completion(temperature=float("inf"))).encode(),
    ),
    (
        "nan-repetition-penalty",
        "/v1/chat/completions",
        json.dumps(ok_chat(repetition_penalty=float("nan"))).encode(),
    ),
    ("deeply-nested", "/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
]

BAD_FIELDS: list[tuple[str, dict[str, object]]] = [
    ("prompt-int", {"prompt": 5}),
    ("prompt-null", {"prompt": None}),
    ("prompt-missing", {"prompt": ...}),
    ("prompt-dict", {"prompt": {"a": 1}}),
    ("max-tokens-string", {"max_tokens": "ten"}),
    ("max-tokens-negative", {"max_tokens": -1}),
    ("max-tokens-zero", {"max_tokens": 0}),
    ("max-tokens-absurd", {"max_tokens": 10**12}),
    ("max-tokens-float", {"max_tokens": 2.5}),
    ("temperature-negative", {"temperature": -1}),
    ("temperature-string", {"temperature": "hot"}),
    ("top-p-zero", {"top_p": 0}),
    ("top-p-two", {"top_p": 2}),
    ("top-k-negative", {"top_k": -5}),
    ("top-k-absurd", {"top_k": 2**40}),
    ("min-p-two", {"min_p": 2}),
    ("n-zero", {"n": 0}),
    ("n-absurd", {"n": 10**6}),
    ("seed-huge", {"seed": 2**80}),
    ("seed-below-int64", {"seed": -(2**63) - 1}),  # OpenAI's seed is int64: -3 is a seed
    ("logprobs-absurd", {"logprobs": 1000}),
    ("logprobs-negative", {"logprobs": -1}),
    ("presence-penalty-absurd", {"presence_penalty": 1e9}),
    ("repetition-penalty-negative", {"repetition_penalty": -1}),
    ("repetition-penalty-huge", {"repetition_penalty": 1e300}),
    ("min-tokens-over-max", {"min_tokens": 5, "max_tokens": 2}),
    ("stop-token-ids-negative", {"stop_token_ids": [-1]}),
    ("stop-token-ids-huge", {"stop_token_ids": [2**40]}),
    ("stop-token-ids-oov", {"stop_token_ids": [10**8]}),
    ("stop-int", {"stop": 7}),
    ("stop-empty-string", {"stop": ""}),  # it matches everywhere: vLLM refuses it too
    ("stop-list-with-an-empty-string", {"stop": [";", ""]}),
    ("stream-string", {"stream": "yes please"}),
    ("stream-options-wrong", {"stream_options": "all"}),
    ("token-ids-negative", {"prompt": [1, -2, 3]}),
    ("token-ids-out-of-vocab", {"prompt": [1, 10**9]}),
    ("token-ids-huge", {"prompt": [2**70]}),
    ("token-ids-floats", {"prompt": [1.5, 2.5]}),
    ("empty-prompt", {"prompt": ""}),
    ("empty-token-list", {"prompt": []}),
    ("batch-past-128-choices", {"prompt": ["a"] * 65, "n": 2}),
    ("batch-with-an-empty-prompt", {"prompt": ["a", ""]}),
    ("prompt-over-context", {"prompt": "a=1;" * 20000}),
    ("prompt-plus-max-tokens-over-context", {"prompt": "a=1;", "max_tokens": 10**6}),
    ("wrong-model", {"model": "gpt-4"}),
    ("echo", {"echo": True}),
]

BAD_CHAT: list[tuple[str, dict[str, object]]] = [
    ("messages-string", {"messages": "hi"}),
    ("messages-empty", {"messages": []}),
    ("message-no-role", {"messages": [{"content": "hi"}]}),
    ("message-content-int", {"messages": [{"role": "user", "content": 3}]}),
    (
        "message-image-part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    ),
    ("top-logprobs-negative", {"logprobs": True, "top_logprobs": -1}),
    ("max-completion-tokens-negative", {"max_completion_tokens": -4}),
    ("huge-chat-over-context", {"messages": [{"role": "user", "content": "b=2;" * 20000}]}),
]


def assert_openai_4xx(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], what
    assert err["type"] in ("invalid_request_error", "authentication_error"), (what, err)
    assert set(err) >= {"message", "type", "code"}


@pytest.mark.parametrize("name,path,raw", RAW_4XX, ids=[r[0] for r in RAW_4XX])
def test_raw_bodies_get_4xx(cluster: Cluster, name: str, path: str, raw: bytes) -> None:
    r = httpx.post(
        cluster.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_4xx(r, name)


@pytest.mark.parametrize("name,fields", BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
def test_bad_completion_fields_get_4xx(
    cluster: Cluster, name: str, fields: dict[str, object]
) -> None:
    payload = ok_completion(**fields)
    payload = {k: v for k, v in payload.items() if v is not ...}
    for stream in (False, True):
        r = httpx.post(
            f"{cluster.url}/v1/completions",
            json={**payload, "stream": payload.get("stream", stream)},
            timeout=30,
        )
        assert_openai_4xx(r, f"{name} stream={stream}")


@pytest.mark.parametrize("name,fields", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_fields_get_4xx(cluster: Cluster, name: str, fields: dict[str, object]) -> None:
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=ok_chat(**fields), timeout=30)
    assert_openai_4xx(r, name)


def test_lone_surrogate_in_prompt_is_not_a_5xx(cluster: Cluster) -> None:
    """JSON may escape a lone UTF-16 surrogate; Python decodes it into a str no encoder takes."""
    raw = b'{"prompt": "a=1;\\ud800 b?", "max_tokens": 2}'
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text


def test_unknown_fields_are_refused_known_ones_honoured(cluster: Cluster) -> None:
    """An unknown field is a 400 naming it (OpenAI's answer; ignoring it would look honoured);
    logit_bias is honoured now."""
    r = httpx.post(f"{cluster.url}/v1/completions", json=ok_completion(frobnicate=3), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text
    r = httpx.post(
        f"{cluster.url}/v1/completions", json=ok_completion(logit_bias={"5": 1}), timeout=30
    )
    assert r.status_code == 200, r.text


def test_ten_megabyte_body_is_413(cluster: Cluster) -> None:
    big = json.dumps(ok_completion(prompt="x" * (10 * 1024 * 1024))).encode()
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        content=big,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

    def chunks() -> Iterator[bytes]:  # no content-length: the cap holds while reading
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    r = httpx.post(
        f"{cluster.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413


def _slow_client(cluster: Cluster, head_only: bool) -> tuple[float, bytes]:
    """A slow-loris: headers (and a byte of body) sent, then nothing; returns (seconds, reply)."""
    host, port = cluster.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    t0 = time.monotonic()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n" + (b"" if head_only else b"{")
    )
    reply = b""
    waited = 0.0
    try:
        while chunk := s.recv(4096):
            reply += chunk
            waited = (
                waited or time.monotonic() - t0
            )  # the answer, not the keep-alive close after it
            if b'"error"' in reply:
                break
    except (TimeoutError, ConnectionResetError):
        pass
    s.close()
    return waited or time.monotonic() - t0, reply


@pytest.mark.parametrize("head_only", [True, False], ids=["no-body", "stalled-body"])
def test_slow_loris_gets_a_bounded_wait(cluster: Cluster, head_only: bool) -> None:
    waited, reply = _slow_client(cluster, head_only)
    assert waited < BODY_TIMEOUT_S + 5, f"a stalled body held the connection {waited:.1f}s"
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"error"' in reply


def test_still_serving_and_drained_after_the_corpus(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.url}/v1/completions", json=ok_completion(), timeout=60)
    assert r.status_code == 200, r.text
    cluster.wait_drained()
    assert "Traceback" not in cluster.log("lb"), "the gateway logged an unexpected error"
