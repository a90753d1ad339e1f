"""An incremental scanner for one JSON tool call: `{"name": "f", "arguments": {...}}`.

Fed text in any split, it finds the call's name and streams the arguments value as the model
wrote it, character by character, without re-parsing the whole buffer on every delta (what
partial-JSON diffing costs). The name is released before any argument text, as the OpenAI
API streams calls; arguments written before the name are held until the name is known.
Arguments given as a JSON string (`"arguments": "{\"a\": 1}"`) are decoded at its end.
"""

from __future__ import annotations

import enum
import json


class Phase(enum.Enum):
    BEFORE = enum.auto()  # before the object's `{`
    KEY = enum.auto()  # expecting a key (or `}`)
    IN_KEY = enum.auto()  # inside a key string
    COLON = enum.auto()  # after a key
    VALUE = enum.auto()  # expecting a value
    IN_VALUE = enum.auto()  # inside a value
    AFTER_VALUE = enum.auto()  # expecting `,` or `}`
    DONE = enum.auto()  # the object closed
    FAILED = enum.auto()  # the text is not a JSON object


class Kind(enum.Enum):
    NAME = enum.auto()
    ARGS = enum.auto()
    SKIP = enum.auto()


_WS = " \t\r\n"


class JsonCallScanner:
    """Scan one call object; `feed` returns (argument text to send, characters consumed)."""

    def __init__(self, name_keys: tuple[str, ...] = ("name",),
                 args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._name_keys = name_keys
        self._args_keys = args_keys
        self.phase = Phase.BEFORE
        self.name: str | None = None
        self.saw_args = False
        self._raw: list[str] = []  # the key, or a name / string / scalar value being read
        self._key = ""
        self._kind = Kind.SKIP
        self._opener = ""  # first character of the current value
        self._vdepth = 0  # bracket depth inside the value
        self._in_str = False
        self._esc = False
        self._pending: list[str] = []  # argument text seen before the name
        self._bare = False  # scanning a bare arguments value, not a call object

    @classmethod
    def arguments_only(cls) -> JsonCallScanner:
        """A scanner for a bare arguments value (`{...}`), for formats that write the name
        outside the JSON; it is done when the value ends."""
        sc = cls()
        sc.phase, sc._key, sc.name, sc._bare = Phase.VALUE, sc._args_keys[0], "", True
        return sc

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def failed(self) -> bool:
        return self.phase is Phase.FAILED

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        i, n = 0, len(text)
        while i < n and self.phase not in (Phase.DONE, Phase.FAILED):
            if self.phase is Phase.IN_VALUE:
                i = self._value(text, i, out)
                continue
            self._structural(text[i])
            i += 1
        return self._release(out), i

    def finish(self) -> str:
        """The text ended inside the object: the argument text still held, if any."""
        if self.phase is Phase.IN_VALUE and self._kind is Kind.ARGS and self._opener != "{":
            return ""  # a string or scalar cut short: nothing well-formed to add
        return self._release([])

    def _release(self, out: list[str]) -> str:
        if self.name is None:
            self._pending.extend(out)
            return ""
        if self._pending:
            out = self._pending + out
            self._pending = []
        return "".join(out)

    def _structural(self, c: str) -> None:
        """One character outside any value (the object's own punctuation and keys)."""
        p = self.phase
        if p is Phase.IN_KEY:
            self._string_char(c, Phase.COLON)
        elif c in _WS:
            return
        elif p is Phase.BEFORE:
            self.phase = Phase.KEY if c == "{" else Phase.FAILED
        elif p is Phase.KEY:
            if c == '"':
                self.phase, self._raw = Phase.IN_KEY, []
            elif c == "}":
                self._close()
            elif c != ",":
                self.phase = Phase.FAILED
        elif p is Phase.COLON:
            self.phase = Phase.VALUE if c == ":" else Phase.FAILED
        elif p is Phase.VALUE:
            self._begin_value(c)
        elif p is Phase.AFTER_VALUE:
            if c == ",":
                self.phase = Phase.KEY
            elif c == "}":
                self._close()
            else:
                self.phase = Phase.FAILED

    def _close(self) -> None:
        """The object's `}`: a call only with a name (an object without one is a JSON answer,
        not a call)."""
        self.phase = Phase.DONE if self.name is not None else Phase.FAILED

    def _string_char(self, c: str, next_phase: Phase) -> None:
        if self._esc:
            self._esc = False
        elif c == "\\":
            self._esc = True
        elif c == '"':
            self._key = _decode_string("".join(self._raw))
            self.phase = next_phase
            return
        self._raw.append(c)

    def _begin_value(self, c: str) -> None:
        key = self._key
        self._kind = (Kind.NAME if key in self._name_keys and self.name is None
                      else Kind.ARGS if key in self._args_keys and not self.saw_args else Kind.SKIP)
        if self._kind is Kind.ARGS:
            self.saw_args = True
        self._opener = c
        self._vdepth = 1 if c in "{[" else 0
        self._in_str = c == '"'
        self._esc = False
        self._raw = [c]
        self.phase = Phase.IN_VALUE

    def _value(self, text: str, i: int, out: list[str]) -> int:
        """Consume value characters from text[i:]; return the index after them."""
        start = i
        n = len(text)
        scalar = self._opener not in '{["'
        while i < n:
            c = text[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._opener == '"':
                        i += 1
                        break
            elif scalar:
                if c in _WS or c in ",}":
                    break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._vdepth += 1
            elif c in "}]":
                self._vdepth -= 1
                if self._vdepth == 0:
                    i += 1
                    break
            i += 1
        else:
            self._collect(text[start:i], out)
            return i
        self._collect(text[start:i], out)
        self._end_value()
        return i

    def _collect(self, piece: str, out: list[str]) -> None:
        if not piece:
            return
        if self._kind is Kind.ARGS and self._opener in "{[":
            if self._raw:  # the opening bracket, held until the value's next character
                out.append("".join(self._raw))
                self._raw = []
            out.append(piece)
        else:
            self._raw.append(piece)

    def _end_value(self) -> None:
        raw = "".join(self._raw)
        if self._kind is Kind.NAME:
            self.name = _decode_string(raw[1:-1]) if raw.startswith('"') else raw
        elif self._kind is Kind.ARGS and self._opener not in "{[":
            value = _decode_string(raw[1:-1]) if self._opener == '"' else raw
            self._pending.append("{}" if value in ("", "null") else value)
        self._raw = []
        self.phase = Phase.DONE if self._bare else Phase.AFTER_VALUE


def _decode_string(body: str) -> str:
    try:
        value = json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return body
    return value if isinstance(value, str) else body
