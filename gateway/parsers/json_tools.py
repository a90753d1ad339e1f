"""Tool-call parsers for formats that write each call as a JSON object.

- `hermes` (also Qwen2.5 / Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  one block per call, free text before them.
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole output is the call(s),
  `{"name": "f", "parameters": {...}}`, several separated by `;`, optionally after
  `<|python_tag|>`; output that does not begin with `{`, or whose first object has no name (a
  JSON answer), is plain content.
- `mistral`: `[TOOL_CALLS]` then either a JSON array of `{"name", "arguments"}` objects
  (tokenizers up to v3) or `name[ARGS]{...}` per call (v11+ tokenizers, each call after its own
  `[TOOL_CALLS]`).

In every format a JSON object with no `name` is not a call (its text is content), and a call
cut short before its name (max_tokens, a stop string) is dropped: neither content nor a call.
"""

from __future__ import annotations

import enum

from gateway.parsers.base import BufferedToolParser, ToolDelta, marker_hold
from gateway.parsers.json_scan import JsonCallScanner


class Mode(enum.Enum):
    TEXT = enum.auto()  # plain content, looking for the next call
    CALL = enum.auto()  # inside a call object
    BETWEEN = enum.auto()  # after a call object, before its closing marker / the next call
    LIST = enum.auto()  # mistral: inside `[...]`, between call objects
    NAME = enum.auto()  # mistral v11: reading `name` up to `[ARGS]`


class _JsonCallsParser(BufferedToolParser):
    """Shared streaming machinery: a call object is scanned by JsonCallScanner."""

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        super().__init__(parameters)
        self.mode = Mode.TEXT
        self._scanner: JsonCallScanner | None = None
        self._call_raw = ""  # the text of a call whose name is not known yet (for a fallback)

    def _new_call(self) -> None:
        self._scanner, self._call_raw, self.mode = JsonCallScanner(), "", Mode.CALL

    def _scan(self, out: ToolDelta) -> bool:
        """Feed the buffer to the current call's scanner; True once the object closed, or
        failed (`_failed`: not a call after all, its text in `_call_raw`)."""
        sc = self._scanner
        assert sc is not None
        had_name = sc.name is not None
        args, used = sc.feed(self._buf)
        if not had_name and sc.name is None:
            self._call_raw += self._buf[:used]
        self._buf = self._buf[used:]
        if sc.failed:
            return True
        if sc.name is not None and not had_name:
            out.calls.append(self._start_call(sc.name))
        out.calls.extend(self._args(args))
        if sc.done:
            if not sc.saw_args:
                out.calls.extend(self._args("{}"))
            self._scanner = None
            return True
        return False

    @property
    def _failed(self) -> bool:
        return self._scanner is not None and self._scanner.failed

    def _finish_call(self, out: ToolDelta) -> None:
        """The text ended inside a call: release held argument text (a truncated call); one
        cut before its name is dropped (`cut_before_name`)."""
        sc = self._scanner
        if sc is not None and sc.name is not None:
            out.calls.extend(self._args(sc.finish()))
        self.cut_before_name = sc is not None and sc.name is None
        self._scanner = None


class HermesParser(_JsonCallsParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    markers = (OPEN, CLOSE)

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        while self._buf:
            if self.mode is Mode.TEXT:
                if not self._text_until(self.OPEN, out):
                    break
                self._new_call()
            elif self.mode is Mode.CALL:
                if not self._step_call(out):
                    break
            else:  # BETWEEN: skip to `</tool_call>`
                i = self._buf.find(self.CLOSE)
                if i == -1:
                    self._buf = self._buf[len(self._buf) - marker_hold(self._buf, (self.CLOSE,)):]
                    break
                self._buf = self._buf[i + len(self.CLOSE):]
                self.mode = Mode.TEXT
        return out

    def _step_call(self, out: ToolDelta) -> bool:
        closed = self._scan(out)
        if self._failed:  # not a JSON call after all: the tag and its text are plain content
            out.content += self._content(self.OPEN + self._call_raw)
            self._scanner, self.mode = None, Mode.TEXT
            return True
        if closed:
            self.mode = Mode.BETWEEN
        return closed

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.mode is Mode.TEXT:
            out.content += self._content(self._buf)
        elif self.mode is Mode.CALL:  # cut inside a call (one cut before its name: dropped;
            self._finish_call(out)  # a text that is not a JSON call became content in `feed`)
        self._buf = ""
        return out


class Llama3JsonParser(_JsonCallsParser):
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        super().__init__(parameters)
        self._decided = False
        self._calls_mode = False
        self._tagged = False  # the output opened with `<|python_tag|>`: calls, not an answer

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        if not self._decided and not self._decide():
            return out
        if not self._calls_mode:
            out.content, self._buf = self._buf, ""
            return out
        while self._buf:
            if self.mode is Mode.CALL:
                if not self._scan(out):
                    break
                self.mode = Mode.BETWEEN
                if self._failed:  # not a call: its text is content (and, first, all the rest)
                    self._scanner, self._calls_mode = None, self.num_calls > 0
                    out.content += self._content(self._call_raw)
                    if not self._calls_mode:
                        out.content, self._buf = out.content + self._buf, ""
                continue
            stripped = self._buf.lstrip(" \t\r\n;")
            if not stripped:
                self._buf = ""
                break
            if stripped[0] != "{":  # text after the calls: plain content
                out.content += self._content(stripped)
                self._buf = ""
                break
            self._buf = stripped
            self._new_call()
        return out

    def _decide(self) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(self.PYTHON_TAG):
            stripped = stripped[len(self.PYTHON_TAG):].lstrip()
            self._tagged = True
        elif self.PYTHON_TAG.startswith(stripped):
            return False  # nothing yet, or a split `<|python_tag|>`
        if not stripped:
            return False
        self._decided = True
        self._calls_mode = stripped[0] == "{"
        if self._calls_mode:
            self._buf = stripped
        return True

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if not self._decided or not self._calls_mode:
            out.content, self._buf = self._buf, ""
            return out
        sc = self._scanner
        if self.mode is Mode.CALL and sc is not None and sc.name is None and not (
                self.num_calls or self._tagged):  # no name and no marker: an answer cut short
            out.content += self._call_raw + self._buf
            self._scanner = None
        elif self.mode is Mode.CALL:
            self._finish_call(out)
        self._buf = ""
        return out


class MistralParser(_JsonCallsParser):
    TOOL_CALLS = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        super().__init__(parameters)
        self._in_list = False  # the current call is an element of a `[...]` array

    def _step(self, out: ToolDelta) -> bool:
        if self.mode is Mode.TEXT:
            if not self._text_until(self.TOOL_CALLS, out):
                return False
            self.mode = Mode.BETWEEN
            return True
        if self.mode is Mode.BETWEEN:  # right after [TOOL_CALLS]: which variant?
            stripped = self._buf.lstrip()
            self._buf = stripped
            if not stripped:
                return False
            if stripped[0] == "[":
                self._buf, self.mode, self._in_list = stripped[1:], Mode.LIST, True
            else:
                self.mode, self._in_list = Mode.NAME, False
            return True
        if self.mode is Mode.LIST:
            stripped = self._buf.lstrip(" \t\r\n,")
            self._buf = stripped
            if not stripped:
                return False
            if stripped[0] == "]":
                self._buf, self.mode = stripped[1:], Mode.TEXT
            else:
                self._new_call()
            return True
        if self.mode is Mode.NAME:
            return self._name_step(out)
        if not self._scan(out):  # Mode.CALL
            return False
        if self._failed:  # not a call: its text is content
            self._scanner = None
            out.content += self._content(self._call_raw)
        self.mode = Mode.LIST if self._in_list else Mode.TEXT
        return True

    def _name_step(self, out: ToolDelta) -> bool:
        """v11+: `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`)."""
        i = self._buf.find(self.ARGS)
        if i == -1:
            return False
        name = self._buf[:i].split(self.CALL_ID)[0].strip()
        self._buf = self._buf[i + len(self.ARGS):]
        out.calls.append(self._start_call(name))
        self._scanner, self._call_raw = JsonCallScanner.arguments_only(), ""
        self.mode = Mode.CALL
        return True

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.mode is Mode.TEXT:
            out.content += self._content(self._buf)
        elif self.mode is Mode.CALL:
            self._finish_call(out)
        self._buf = ""
        return out
