"""Incremental detokenization and stop strings for streamed output.

`IncrementalDetokenizer` turns token ids into text deltas. Decoding one token alone is wrong
for byte-level and merged tokens (a multi-byte character can span tokens; SentencePiece-style
decoders drop or add a leading space depending on context), so it decodes a short window:
`prefix_offset..read_offset` is text already emitted, `prefix_offset..end` is the window with
the new tokens, and the delta is the difference — held back while it ends in U+FFFD, the mark
of an incomplete UTF-8 sequence.

`StopStringMatcher` truncates text before the first stop string. A stop string can arrive split
across deltas, so it holds back at most the last `len(longest stop) - 1` characters — only the
suffix that could begin a stop string — until more text (or the end) settles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids, get text deltas; `skip_special_tokens` drops special tokens' text."""

    __slots__ = ("_tok", "_skip", "ids", "_prefix_offset", "_read_offset")

    # Tokens of left context decoded with the new ones: enough for decoders that look back
    # (space handling, byte fallback) while keeping each step O(1).
    CONTEXT = 5

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True,
                 prompt_tail: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Seeding with the prompt's last tokens lets the first output token decode in context.
        self.ids: list[int] = list(prompt_tail[-self.CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def step(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids` and return the text they complete ("" while bytes are pending)."""
        self.ids.extend(new_ids)
        ids = self.ids
        prefix_text = self._tok.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tok.decode(ids[self._prefix_offset:], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self._prefix_offset = max(self._read_offset, len(ids) - self.CONTEXT)
            self._read_offset = len(ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text of trailing tokens still held back (an incomplete character at the end)."""
        prefix_text = self._tok.decode(self.ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tok.decode(self.ids[self._prefix_offset:], self._skip)
        self._read_offset = len(self.ids)
        self._prefix_offset = self._read_offset
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Cut streamed text before the first stop string, across delta boundaries."""

    __slots__ = ("_stops", "_hold", "_buf", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the text safe to emit now; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        buf = self._buf + delta
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.stopped = True
            self._buf = ""
            return buf[:cut]
        # Everything but a possible stop-string start at the end can go out: hold back the
        # longest suffix (at most len(longest stop) - 1 chars) that begins some stop string.
        keep = 0
        for k in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[len(buf) - k:]
            if any(s.startswith(tail) for s in self._stops):
                keep = k
                break
        self._buf = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation, the held-back text is final."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
