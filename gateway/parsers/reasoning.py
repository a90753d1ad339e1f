"""Reasoning parsers: split a model's `<think>...</think>` block from its answer.

Two families, both with `<think>` / `</think>` markers:
- `qwen3`: the model opens the block itself (`<think>\\n...\\n</think>\\n\\n answer`); output that
  does not begin with `<think>` is all answer (Qwen3 with enable_thinking=false, whose template
  writes an empty block into the prompt).
- `deepseek_r1`: the output begins in reasoning whether or not the model writes `<think>`
  (DeepSeek-R1's template opens the block in the prompt; older checkpoints skip the tag), so
  everything up to `</think>` is reasoning, and an output with no `</think>` is all reasoning.
For both, a prompt whose last `<think>` is still open (the template opened the block in the
generation prompt) starts the output in reasoning; `prompt_opens_reasoning` decides that.
Whitespace right after `<think>`, around `</think>`, is dropped: it is the format's, not
the model's words.
"""

from __future__ import annotations

import enum

from gateway.parsers.base import marker_hold

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ThinkState(enum.Enum):
    START = enum.auto()  # nothing decisive seen yet: is there a `<think>`?
    REASONING = enum.auto()  # inside the block
    AFTER = enum.auto()  # just past `</think>`: leading whitespace of the answer is dropped
    CONTENT = enum.auto()  # the answer


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open think block."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def prompt_closes_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends with a closed think block: thinking off, as Qwen3's
    template writes it (`<think>\\n\\n</think>\\n\\n`); the answer starts at once."""
    return prompt_text.rstrip().endswith(THINK_CLOSE)


class ThinkParser:
    """Streaming split of reasoning and content for one request."""

    markers = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, name: str, starts_in_reasoning: bool) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        # deepseek_r1 reasons first even when the prompt did not open the block.
        self._always = name == "deepseek_r1" or starts_in_reasoning
        self.state = ThinkState.START
        self._buf = ""
        self._reasoning_started = False  # text after `<think>` whitespace began

    @property
    def in_reasoning(self) -> bool:
        """Inside the block (undecided starts count only where the output begins in it)."""
        if self.state is ThinkState.START:
            return self._always
        return self.state is ThinkState.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        """Consume text; return (reasoning, content) that may be sent now."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            st = self.state
            if st is ThinkState.START and not self._start():
                break
            if st is ThinkState.REASONING:
                if not self._reasoning(reasoning):
                    break
            elif st is ThinkState.AFTER:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self.state = stripped, ThinkState.CONTENT
            elif st is ThinkState.CONTENT:
                content.append(self._buf)
                self._buf = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever is held is final (an unclosed block stays reasoning)."""
        buf, self._buf = self._buf, ""
        if self.state is ThinkState.START:
            stripped = buf.lstrip()
            if self._always:
                return stripped.rstrip(), ""
            return "", buf
        if self.state is ThinkState.REASONING:
            return (buf.rstrip() if self._reasoning_started else buf.strip()), ""
        if self.state is ThinkState.CONTENT:
            return "", buf
        return "", ""

    def _start(self) -> bool:
        """Decide how the output begins; False while the buffer cannot tell yet."""
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN):]
            self.state = ThinkState.REASONING
            return True
        if stripped and THINK_OPEN.startswith(stripped):
            return False  # maybe `<think>` split across deltas
        if not stripped:
            return False
        self.state = ThinkState.REASONING if self._always else ThinkState.CONTENT
        return True

    def _reasoning(self, out: list[str]) -> bool:
        """Emit reasoning up to `</think>`; True when the block closed (state moved on)."""
        buf = self._buf
        if not self._reasoning_started:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._reasoning_started = True
        end = buf.find(THINK_CLOSE)
        if end != -1:
            out.append(buf[:end].rstrip())
            self._buf = buf[end + len(THINK_CLOSE):]
            self.state = ThinkState.AFTER
            return True
        # Hold a possible split `</think>` and trailing whitespace (dropped if the block ends).
        hold = marker_hold(buf, (THINK_CLOSE,))
        body = buf[:len(buf) - hold]
        keep_ws = len(body) - len(body.rstrip())
        cut = len(body) - keep_ws
        out.append(buf[:cut])
        self._buf = buf[cut:]
        return False
