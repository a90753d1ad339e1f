"""A chat request's output, read by its parsers: reasoning, content and tool calls.

`ChatOutput` sits after the detokenizer and stop strings (gateway/output.py): it is fed text
(one piece per token when a reasoning parser counts reasoning tokens) and returns `ChatPiece`s,
which the streaming path turns into OpenAI chunks and the non-streaming path accumulates into
one message. Both paths go through the same parsers, so a streamed answer assembles to the
same message. With `parallel_tool_calls` false, a second call is not parsed: the output stops
there (`stop_now`) and the worker is aborted, as with a stop string.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field

from gateway.agent_types import FunctionCall, ToolCall
from gateway.agents import ChatPlan
from gateway.chunks import call_delta, content_delta, reasoning_delta
from gateway.parsers import CallDelta, ToolDelta

_ALNUM = string.ascii_letters + string.digits


def new_call_id(parser: str) -> str:
    # Mistral's templates refuse a tool_call_id that is not 9 letters or digits.
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class CallPiece:
    """One streamed piece of a tool call; the call's first carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ChatPiece:
    """What one feed lets out, in order: reasoning, then content, then call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def delta_json(self) -> list[bytes]:
        """As OpenAI stream deltas (ChatDelta's JSON, byte for byte: tests/gateway/
        test_chunks.py): one per kind, and one per call piece (a call's first carries id, type
        and name with empty arguments, as OpenAI sends it)."""
        out = []
        if self.reasoning:
            out.append(reasoning_delta(self.reasoning))
        if self.content:
            out.append(content_delta(self.content))
        out.extend(call_delta(c.index, c.arguments, c.id, c.name) for c in self.calls)
        return out


class ChatOutput:
    """Parsers and accumulated message of one chat request."""

    def __init__(self, plan: ChatPlan) -> None:
        self._think, self._tools = plan.new_parsers()
        self._tool_parser = plan.tool_parser
        self._parallel = plan.parallel_tool_calls
        self._named = plan.named_tool_choice
        self.per_token = self._think is not None  # reasoning tokens are counted per token
        self.plain = self._think is None and self._tools is None  # no parser: text is content
        self.has_reasoning_parser = self._think is not None
        self.reasoning_tokens = 0
        self.stop_now = False  # a second call began with parallel_tool_calls off
        self.call_cut = False  # the output ended inside its last call (its arguments unfinished)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        # Whitespace-only content not streamed yet: a turn that turns out to be only calls has
        # no content (message_content), so the stream must not have sent it either.
        self._held_space = ""

    def feed(self, pieces: list[str], tail: str = "") -> ChatPiece:
        """Text pieces (one per token when `per_token`), then `tail`, text of no token (held
        back until the output ended: OutputAssembler.add_token_pieces); returns what may be sent
        now."""
        out = ChatPiece()
        for i, text in enumerate([*pieces, tail] if tail else pieces):
            if self.stop_now:
                break
            if self._think is None:
                self._content(text, out)
                continue
            before = self._think.in_reasoning
            reasoning, content = self._think.feed(text)
            if (before or self._think.in_reasoning) and i < len(pieces):
                self.reasoning_tokens += 1
            self._reason(reasoning, out)
            self._content(content, out)
        return out

    def add_content(self, text: str) -> None:
        """Text of a request with no parser (`plain`): content as it is, for the message."""
        self.content.append(text)

    def finish(self) -> ChatPiece:
        """The output ended: release what the parsers hold."""
        out = ChatPiece()
        if self._think is not None:
            reasoning, content = self._think.finish()
            self._reason(reasoning, out)
            self._content(content, out)
        if self._tools is not None and not self.stop_now:
            self._take(self._tools.finish(), out)
            self.call_cut = self._tools.cut_before_name or (
                bool(self.calls) and not _is_json(self.calls[-1].function.arguments))
        if not self.calls:  # no calls after all: the whitespace is the content
            out.content += self._held_space
        self._held_space = ""
        return out

    def finish_reason(self, worker_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the turn ended in calls (not when it was cut short:
        by max_tokens, or by a stop string inside the last call); "stop" when tool_choice
        named the function (OpenAI answers a forced named call so)."""
        if self.calls and not self.call_cut and (self.stop_now or worker_reason == "stop"):
            return "stop" if self._named else "tool_calls"
        return worker_reason

    def message_content(self) -> str | None:
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text

    def message_reasoning(self) -> str | None:
        text = "".join(self.reasoning)
        return text if self.has_reasoning_parser and text else None

    def _reason(self, text: str, out: ChatPiece) -> None:
        if text:
            self.reasoning.append(text)
            out.reasoning += text

    def _content(self, text: str, out: ChatPiece) -> None:
        if not text:
            return
        if self._tools is None:
            self.content.append(text)
            out.content += text
            return
        self._take(self._tools.feed(text), out)

    def _take(self, delta: ToolDelta, out: ChatPiece) -> None:
        if delta.content:
            self.content.append(delta.content)
            self._send_content(delta.content, out)
        for c in delta.calls:
            if c.index > 0 and not self._parallel:
                self.stop_now = True
                return
            out.calls.append(self._call_delta(c))

    def _send_content(self, text: str, out: ChatPiece) -> None:
        """Content beside calls: whitespace waits until other text follows it (or the output
        ends with no call), so the stream assembles to `message_content`."""
        if self._held_space or len(self.content) == 1:  # nothing but whitespace sent so far
            if not text.strip():
                self._held_space += text
                return
            text, self._held_space = self._held_space + text, ""
        out.content += text

    def _call_delta(self, c: CallDelta) -> CallPiece:
        if c.name is not None:
            call_id = new_call_id(self._tool_parser)
            self.calls.append(ToolCall(id=call_id, function=FunctionCall(name=c.name,
                                                                         arguments="")))
            return CallPiece(c.index, id=call_id, name=c.name)
        fn = self.calls[c.index].function
        fn.arguments += c.arguments
        return CallPiece(c.index, c.arguments)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
