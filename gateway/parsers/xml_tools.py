"""Tool-call parsers for formats that are not one JSON object per call.

- `qwen3_coder` (Qwen3-Coder's XML):
  `<tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`.
  Values are written raw; each is typed by the tool's JSON schema (a `string` stays text, an
  `enum` / `const` member without the whitespace the format lets around it; `integer` /
  `number` / `boolean` / `object` / `array` are parsed, falling back to text), and
  the call's arguments are streamed as a JSON object, one parameter at a time.
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
  `deepseek_v31` (V3.1 on) writes
  `<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from gateway.parsers.base import BufferedToolParser, ToolDelta, marker_hold
from gateway.parsers.json_scan import JsonCallScanner


class XmlState(enum.Enum):
    TEXT = enum.auto()
    FUNCTION = enum.auto()  # after <tool_call>, waiting for <function=name>
    PARAMS = enum.auto()  # inside <function>, between parameters
    VALUE = enum.auto()  # inside <parameter=k>, up to </parameter>
    CLOSING = enum.auto()  # after </function>, skipping to </tool_call>


def typed_value(raw: str, schema: Any) -> Any:
    """A raw XML parameter value as the JSON value its schema asks for."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type decides
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return _member(raw, schema)
    if raw.strip() == "null":
        return None
    try:
        if kind == "integer":
            return int(raw.strip())
        if kind == "number":
            f = float(raw.strip())
            return int(f) if f.is_integer() and "." not in raw and "e" not in raw.lower() else f
        if kind == "boolean":
            low = raw.strip().lower()
            return {"true": True, "false": False}.get(low, raw)
        return json.loads(raw)
    except ValueError:
        return raw


def _member(raw: str, schema: Any) -> str:
    """A string value of an `enum` / `const` as its member: the XML format lets whitespace
    around a value (the gateway's grammar one character a side), which a member does not hold."""
    if not isinstance(schema, dict) or ("enum" not in schema and "const" not in schema):
        return raw
    members = schema["enum"] if "enum" in schema else [schema["const"]]
    stripped = raw.strip()
    return stripped if raw not in members and stripped in members else raw


class Qwen3CoderParser(BufferedToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNC, FUNC_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    markers = (OPEN, CLOSE)

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None) -> None:
        super().__init__(parameters)
        self.state = XmlState.TEXT
        self._name = ""
        self._key = ""
        self._num_params = 0

    def _step(self, out: ToolDelta) -> bool:
        st = self.state
        if st is XmlState.TEXT:
            if not self._text_until(self.OPEN, out):
                return False
            self.state = XmlState.FUNCTION
            return True
        if st is XmlState.FUNCTION:
            i = self._buf.find(self.FUNC)
            j = self._buf.find(">", i + len(self.FUNC)) if i != -1 else -1
            if j == -1:
                return False
            self._name = self._buf[i + len(self.FUNC):j].strip()
            self._buf, self.state, self._num_params = self._buf[j + 1:], XmlState.PARAMS, 0
            out.calls.append(self._start_call(self._name))
            return True
        if st is XmlState.PARAMS:
            return self._params_step(out)
        if st is XmlState.VALUE:
            return self._value_step(out)
        i = self._buf.find(self.CLOSE)  # CLOSING
        if i == -1:
            self._buf = self._buf[len(self._buf) - marker_hold(self._buf, (self.CLOSE,)):]
            return False
        self._buf, self.state = self._buf[i + len(self.CLOSE):], XmlState.TEXT
        return True

    def _params_step(self, out: ToolDelta) -> bool:
        stripped = self._buf.lstrip()
        self._buf = stripped
        if stripped.startswith(self.PARAM):
            j = stripped.find(">")
            if j == -1:
                return False
            self._key = stripped[len(self.PARAM):j].strip()
            self._buf, self.state = stripped[j + 1:], XmlState.VALUE
            return True
        if stripped.startswith(self.FUNC_END):
            out.calls.extend(self._args("}" if self._num_params else "{}"))
            self._buf, self.state = stripped[len(self.FUNC_END):], XmlState.CLOSING
            return True
        if self.PARAM.startswith(stripped) or self.FUNC_END.startswith(stripped):
            return False  # a marker split across deltas
        # Stray text between parameters is not part of the format: dropped up to the next
        # possible marker (never past it: how the text was split must not matter).
        k = stripped.find("<", 1)
        self._buf = stripped[k:] if k != -1 else ""
        return k != -1

    def _value_step(self, out: ToolDelta) -> bool:
        ends = [k for k in (self._buf.find(m) for m in (self.PARAM_END, self.PARAM, self.FUNC_END))
                if k != -1]
        if not ends:
            return False
        k = min(ends)
        raw = self._buf[:k]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        self._emit_param(out, raw)
        rest = self._buf[k:]
        self._buf = rest[len(self.PARAM_END):] if rest.startswith(self.PARAM_END) else rest
        self.state = XmlState.PARAMS
        return True

    def _emit_param(self, out: ToolDelta, raw: str) -> None:
        props = self.parameters.get(self._name, {}).get("properties", {})
        schema = props.get(self._key) if isinstance(props, dict) else None
        value = typed_value(raw, schema)
        sep = "{" if self._num_params == 0 else ", "
        self._num_params += 1
        piece = f"{sep}{json.dumps(self._key, ensure_ascii=False)}: "
        out.calls.extend(self._args(piece + json.dumps(value, ensure_ascii=False)))

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state is XmlState.TEXT:
            out.content += self._trailing.feed(self._buf) if self.num_calls else self._buf
        elif self.state is XmlState.FUNCTION:
            head = self._buf.lstrip()
            if self.FUNC.startswith(head) or head.startswith(self.FUNC):
                self.cut_before_name = True  # cut before the name: its markup is not content
            else:  # not the format after all: the text as it came
                out.content += self._trailing.feed(self.OPEN + self._buf) if self.num_calls \
                    else self.OPEN + self._buf
        elif self.state is XmlState.VALUE:  # cut short inside a value: keep what arrived
            self._value_step_final(out)
        self._buf = ""
        return out

    def _value_step_final(self, out: ToolDelta) -> None:
        self._emit_param(out, self._buf.strip("\n"))
        out.calls.extend(self._args("}"))


class DSState(enum.Enum):
    TEXT = enum.auto()
    CALLS = enum.auto()  # inside <｜tool▁calls▁begin｜>, between calls
    HEAD = enum.auto()  # after <｜tool▁call▁begin｜>: type / name up to the arguments
    ARGS = enum.auto()  # the arguments object
    CALL_TAIL = enum.auto()  # after the arguments, up to <｜tool▁call▁end｜>


class DeepSeekV3Parser(BufferedToolParser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def __init__(self, parameters: dict[str, dict[str, object]] | None = None,
                 v31: bool = False) -> None:
        super().__init__(parameters)
        self.v31 = v31  # name before the separator, bare JSON after it
        self.state = DSState.TEXT
        self._scanner: JsonCallScanner | None = None

    def _step(self, out: ToolDelta) -> bool:
        st = self.state
        if st is DSState.TEXT:
            if not self._text_until(self.CALLS_BEGIN, out):
                return False
            self.state = DSState.CALLS
            return True
        if st is DSState.CALLS:
            stripped = self._buf.lstrip()
            self._buf = stripped
            for marker, nxt in ((self.CALL_BEGIN, DSState.HEAD), (self.CALLS_END, DSState.TEXT)):
                if stripped.startswith(marker):
                    self._buf, self.state = stripped[len(marker):], nxt
                    return True
            if not stripped or any(m.startswith(stripped) for m in (self.CALL_BEGIN,
                                                                    self.CALLS_END)):
                return False  # nothing yet, or a marker split across deltas
            # Stray text inside the calls block is not part of the format: dropped up to the
            # next possible marker (never past it: how the text was split must not matter).
            k = stripped.find("<", 1)
            self._buf = stripped[k:] if k != -1 else ""
            return k != -1
        if st is DSState.HEAD:
            return self._head_step(out)
        if st is DSState.ARGS:
            sc = self._scanner
            assert sc is not None
            args, used = sc.feed(self._buf)
            self._buf = self._buf[used:]
            out.calls.extend(self._args(args))
            if not (sc.done or sc.failed):
                return False
            self._scanner, self.state = None, DSState.CALL_TAIL
            return True
        i = self._buf.find(self.CALL_END)  # CALL_TAIL
        if i == -1:
            self._buf = self._buf[len(self._buf) - marker_hold(self._buf, (self.CALL_END,)):]
            return False
        self._buf, self.state = self._buf[i + len(self.CALL_END):], DSState.CALLS
        return True

    def _head_step(self, out: ToolDelta) -> bool:
        """V3: `function<｜tool▁sep｜>name\\n```json\\n` ; V3.1: `name<｜tool▁sep｜>`."""
        i = self._buf.find(self.SEP)
        if i == -1:
            return False
        after = self._buf[i + len(self.SEP):]
        if self.v31:
            name, rest = self._buf[:i].strip(), after
        else:
            j = after.find("{")
            if j == -1:
                return False
            name, rest = after[:j].split("\n")[0].strip(), after[j:]
        out.calls.append(self._start_call(name))
        self._buf, self.state = rest.lstrip(), DSState.ARGS
        self._scanner = JsonCallScanner.arguments_only()
        return True

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state is DSState.TEXT:
            out.content += self._trailing.feed(self._buf) if self.num_calls else self._buf
        elif self.state is DSState.ARGS and self._scanner is not None:
            out.calls.extend(self._args(self._scanner.finish()))
        self._buf = ""
        return out
