"""What every output parser shares: the deltas it returns and the hold-back rule.

A parser is fed the request's text as it streams (any split, down to one character) and
returns what may be sent now. Markers (`<think>`, `<tool_call>`, ...) can arrive split across
deltas, so a parser holds back the longest suffix of its buffer that could still begin a
marker (`marker_hold`) until more text, or the end, settles it. Non-streaming responses feed
the whole text once and then `finish()`: the same code path, so both agree by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class CallDelta:
    """A piece of one tool call, in the order the OpenAI API streams them."""

    index: int  # the call's position in the message's tool_calls (0, 1, ...)
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next characters of the call's arguments (JSON text)


@dataclass
class ToolDelta:
    """What a tool-call parser lets out for one feed: plain content and call pieces."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


def marker_hold(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class ToolParser(ABC):
    """Splits content into plain text and tool calls for one request (streaming state)."""

    # Marker strings this format writes; the gateway keeps these tokens when it detokenizes
    # even if they are special tokens (their text is what the parser looks for).
    markers: tuple[str, ...] = ()

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        # Tool name -> its JSON schema `parameters` (formats that write values untyped need it).
        self.parameters = parameters or {}
        self.num_calls = 0  # calls started so far
        # The text ended inside a call before its name (max_tokens, a stop string): the call's
        # markup is dropped, neither content nor a call (set by `finish`).
        self.cut_before_name = False

    @abstractmethod
    def feed(self, text: str) -> ToolDelta:
        """Consume the next piece of content; return what may be sent now."""

    @abstractmethod
    def finish(self) -> ToolDelta:
        """The output ended: release whatever is held back."""

    def _start_call(self, name: str) -> CallDelta:
        delta = CallDelta(index=self.num_calls, name=name)
        self.num_calls += 1
        return delta

    def _args(self, text: str) -> list[CallDelta]:
        """An arguments piece of the current (last started) call; none for empty text."""
        return [CallDelta(index=self.num_calls - 1, arguments=text)] if text else []


class TrailingText:
    """Text outside calls once a call has begun: whitespace between calls is dropped, other
    text is content. Whitespace is held until non-space text (or the end) decides; once text
    came after a call, what follows it is that text's own, until the next call (`call`)."""

    __slots__ = ("_held", "_in_text")

    def __init__(self) -> None:
        self._held = ""
        self._in_text = False

    def feed(self, text: str) -> str:
        buf = self._held + text
        if self._in_text or buf.strip():
            self._held, self._in_text = "", True
            return buf
        self._held = buf
        return ""

    def call(self) -> None:
        """A call began: whitespace after it is held again."""
        self._held, self._in_text = "", False

    def finish(self) -> str:
        self._held = ""
        return ""


class BufferedToolParser(ToolParser):
    """A tool parser that moves through its states over a text buffer: `feed` appends to it and
    takes one `_step` after another until a step needs more text."""

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        super().__init__(parameters)
        self._buf = ""
        self._trailing = TrailingText()

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        while self._buf and self._step(out):
            pass
        return out

    def _start_call(self, name: str) -> CallDelta:
        self._trailing.call()
        return super()._start_call(name)

    def _step(self, out: ToolDelta) -> bool:
        """One move of the state machine; False when it needs more text."""
        raise NotImplementedError(f"{type(self).__name__} feeds its buffer itself")

    def _content(self, text: str) -> str:
        """Plain text: before any call it is content as is; after one, whitespace is dropped."""
        return self._trailing.feed(text) if self.num_calls else text

    def _text_until(self, marker: str, out: ToolDelta) -> bool:
        """Plain text up to `marker` goes out as content (a split marker at the end is held
        back); True once the marker is found, the buffer then starting right after it."""
        i = self._buf.find(marker)
        if i == -1:
            cut = len(self._buf) - marker_hold(self._buf, (marker,))
            out.content += self._content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        out.content += self._content(self._buf[:i])
        self._buf = self._buf[i + len(marker):]
        return True
