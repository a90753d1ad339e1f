"""Fuzz the OpenAI request schema through a real gateway (hypothesis).

Bodies are drawn from the gateway's own request schema (the pydantic models' JSON schema, the
part of an OpenAPI document that describes them): every field is left out, given a value of
its declared type (edge values included: 0, negatives, huge ints, NaN, Infinity, empty and odd
strings), or a value of the wrong type; unknown fields are mixed in. Whatever arrives, the
gateway answers 200 or a 4xx with an OpenAI-shaped error — never a 5xx — and stays up.
A one-worker (mono) cluster serves: the gateway's validation is the same for PD.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.openai_types import ChatCompletionRequest, CompletionRequest
from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = pytest.mark.slow
STATUSES: Counter[int] = Counter()  # what the fuzzed bodies got (the last test checks the spread)

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
)
ANY_JSON = st.recursive(
    _json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
EDGE_INTS = st.one_of(
    st.integers(-3, 8), st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63)])
)
EDGE_FLOATS = st.one_of(
    st.floats(-3, 3), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0])
)
TEXT = st.one_of(
    st.text(max_size=40), st.sampled_from(["", "a=1;\na?", "\x00", "\u202e", "💥" * 5])
)


def of_type(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of the type a JSON-schema node declares (edge values weighted in)."""
    if "$ref" in schema:
        return of_type(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of(*(of_type(s, defs) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "integer":
        return EDGE_INTS
    if kind == "number":
        return st.one_of(EDGE_FLOATS, EDGE_INTS)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return TEXT
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(of_type(schema.get("items", {}), defs), max_size=4)
    if kind == "object":
        props = schema.get("properties", {})
        return (
            st.fixed_dictionaries({}, optional={k: of_type(v, defs) for k, v in props.items()})
            if props
            else st.dictionaries(st.text(max_size=8), ANY_JSON, max_size=3)
        )
    return ANY_JSON


def bodies(model: type[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with 0-4 of its fields set by the fuzzer (declared type, edge value, wrong
    type, or deleted), plus unknown fields now and then: many reach the workers, many do not."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    fields = {
        name: st.one_of(of_type(s, defs), of_type(s, defs), ANY_JSON)  # mostly the right type
        for name, s in schema["properties"].items()
    }
    fields["unknown_field"] = ANY_JSON
    chat = "messages" in fields
    base: dict[str, Any] = {"model": MODEL.name, "max_tokens": 3}
    if chat:
        base["messages"] = [{"role": "user", "content": "a=1;\na?"}]
    else:
        base["prompt"] = "a=1;\na?"

    @st.composite
    def draw(d: st.DrawFn) -> dict[str, Any]:
        body = dict(base)
        for name in d(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
            if d(st.integers(0, 9)) == 0:
                body.pop(name, None)
            else:
                body[name] = d(fields[name])
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = d(
                st.sampled_from([body["max_tokens"], 8])
            )  # huge ones are refused; keep runs short
        return body

    return draw()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(
        "configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("fuzz"), model=MODEL
    ) as c:
        yield c


def _post(c: Cluster, path: str, payload: dict[str, Any]) -> None:
    raw = json.dumps(
        payload, allow_nan=True
    ).encode()  # NaN/Infinity literals included, as Python clients send
    r = httpx.post(
        c.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    STATUSES[r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code} for {raw[:400]!r}: {r.text[:300]}"
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", r.text
    elif payload.get("stream") is not True:
        assert "choices" in r.json(), r.text


SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@SETTINGS
@given(payload=bodies(CompletionRequest))
def test_fuzz_completions(cluster: Cluster, payload: dict[str, Any]) -> None:
    _post(cluster, "/v1/completions", payload)


@SETTINGS
@given(payload=bodies(ChatCompletionRequest))
def test_fuzz_chat(cluster: Cluster, payload: dict[str, Any]) -> None:
    _post(cluster, "/v1/chat/completions", payload)


def test_gateway_alive_and_drained_after_fuzzing(cluster: Cluster) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/completions", json={"prompt": "a=1;\na?", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text
    cluster.wait_drained()
    # The fuzzing reached the workers, not only the first validation check.
    assert STATUSES[200] >= 10 and sum(v for k, v in STATUSES.items() if 400 <= k < 500) >= 10, (
        STATUSES
    )
