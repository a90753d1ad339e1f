"""A test double of an OpenAI chat server with a hermes tool-call parser, for the lookup gate.

It is not a model: it reads the lookup problem out of the first user message (assignments,
then the question) and answers as a server whose model behaves would: tool calls for the
asked variables the prompt does not assign, then, after the `tool` messages, the answer
built from the prompt and the tool results. A per-request rule makes it go wrong in one way
("wrong_call", "bad_json", "no_call", "wrong_answer", "no_reasoning", "fail"). It checks
the requests as a real gateway would (tools given, every `tool` message answering a call id
of the assistant message before it) and answers 400 otherwise. Non-streaming only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.orchestrator.http_double import HttpDouble, JsonHandler

# rule(index of the request, "calls" | "answer") -> "right" or one of the ways to go wrong
Rule = Callable[[int, str], str]


@dataclass
class ChatDoubleState:
    rule: Rule = lambda i, turn: "right"
    model: str = "double-model"
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received
    lock: threading.Lock = field(default_factory=threading.Lock)


class BadRequestError(ValueError):
    """The request is not what a gateway accepts; the double answers 400 with the message."""


def _parse(prompt: str) -> tuple[dict[str, str], list[str]]:
    body, _, question = prompt.rpartition("\n")
    assigned = dict(item.split("=", 1) for item in body.split(";") if item)
    return assigned, question.rstrip("?").split(",")


def _check(body: dict[str, Any]) -> None:
    names = [t.get("function", {}).get("name") for t in body.get("tools") or []]
    if "lookup" not in names:
        raise BadRequestError(f"tools must offer lookup, got {names}")
    messages = body["messages"]
    for i, m in enumerate(messages):
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequestError(f"messages[{i}].role {m['role']!r} is unknown")
        if m["role"] == "tool":
            prev = next(p for p in reversed(messages[:i]) if p["role"] != "tool")
            ids = [c["id"] for c in prev.get("tool_calls") or []]
            if m.get("tool_call_id") not in ids:
                raise BadRequestError(f"messages[{i}].tool_call_id must be one of {ids}")


def _reply(body: dict[str, Any], verdict: str) -> dict[str, Any]:
    messages = body["messages"]
    assigned, asked = _parse(next(m["content"] for m in messages if m["role"] == "user"))
    missing = [name for name in asked if name not in assigned]
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if messages[-1]["role"] == "user":
        if verdict == "wrong_call":
            missing = missing[::-1] + ["zz"]
        # bad_json: Python's repr of the object, which is not JSON
        args = [repr({"name": n}) if verdict == "bad_json" else json.dumps({"name": n})
                for n in missing]
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": a}}
            for i, a in enumerate(args)
        ]
        finish = "tool_calls"
        if verdict == "no_call":
            message = {"role": "assistant", "content": ",".join(f"{n}=?" for n in asked) + ";"}
            finish = "stop"
    else:
        results = [m["content"] for m in messages if m["role"] == "tool"]
        values = {**dict(zip(missing, results, strict=False)), **assigned}
        answer = ",".join(f"{n}={values.get(n, '?')}" for n in asked)
        if verdict == "wrong_answer":
            answer = answer[::-1]
        message["content"] = answer + ";"
        finish = "stop"
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking")
    if thinking and verdict != "no_reasoning":
        message["reasoning_content"] = ";".join(f"{n}=?" for n in asked)
    return {"id": "chatcmpl-double", "object": "chat.completion", "created": 0,
            "model": body["model"], "choices": [{"index": 0, "message": message,
                                                 "finish_reason": finish}]}


class _Handler(JsonHandler):

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "invalid_request_error",
                                      "code": status}})

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/models":
            self._json(200, {"object": "list",
                             "data": [{"id": self.server.state.model, "object": "model",
                                       "created": 0, "owned_by": "double"}]})
        else:
            self._error(404, "no such path")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        st = self.server.state
        with st.lock:
            index = len(st.requests)
            st.requests.append(body)
        if self.path != "/v1/chat/completions":
            self._error(404, "no such path")
            return
        verdict = st.rule(index, "calls" if body["messages"][-1]["role"] == "user" else "answer")
        if verdict == "fail":
            self._error(503, "no healthy worker")
            return
        try:
            _check(body)
        except BadRequestError as exc:
            self._error(400, str(exc))
            return
        self._json(200, _reply(body, verdict))


class ChatDouble(HttpDouble):
    """Context manager: `with ChatDouble(state) as url:` serves until the block ends."""

    handler = _Handler
