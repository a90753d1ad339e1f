"""The bytes a token stands for, for logprobs' `token` and `bytes` fields.

OpenAI documents `bytes` as the token's UTF-8 bytes, "useful in instances where characters are
represented by multiple tokens and their byte representations must be combined to generate the
correct text representation". Decoding one token alone cannot give them: a byte-level piece of
an emoji decodes to U+FFFD (whose bytes are EF BF BD, not the piece's), and a SentencePiece
decoder strips the leading space of "▁world" when it stands first. So the bytes come from the
piece itself, read the way the tokenizer's decoder reads pieces:

- ByteLevel (GPT-2, Llama-3, Qwen): each character of the piece is one byte (GPT-2's table);
- ByteFallback (Llama-2, Mistral): `<0xNN>` is the byte NN; other pieces are text;
- Metaspace, or a Replace of "▁" (SentencePiece): "▁" is a space;
- added tokens (special or not) are their content;
- any other decoder (WordPiece, WordLevel, none): the token decoded alone, as before.

`token_text` names a token by its bytes: their text when they are whole UTF-8, else the bytes
escaped (`\\xf0\\x9f`, as DeepSeek's API writes a piece of a character), never U+FFFD.
`TextOffsets` counts /v1/completions' `text_offset` over a stream of such bytes.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character each byte is written as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _decoder_steps(spec: Any) -> list[dict[str, Any]]:
    """The decoder's steps in order (a Sequence flattened)."""
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [s for d in spec.get("decoders", []) for s in _decoder_steps(d)]
    return [spec]


class TokenBytes:
    """Each token id's bytes (cached); see the module doc for how each decoder reads pieces."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        steps = _decoder_steps(json.loads(hf.decoder.__getstate__()) if hf.decoder else None)
        kinds = {s.get("type") for s in steps}
        self._byte_level = _gpt2_byte_decoder() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        # (pattern, replacement) pairs a SentencePiece decoder applies to every piece
        self._replace: list[tuple[str, str]] = []
        for s in steps:
            if s.get("type") == "Metaspace":
                self._replace.append((s.get("replacement", "▁"), " "))
            elif s.get("type") == "Replace" and isinstance(s.get("pattern"), dict) \
                    and "String" in s["pattern"]:
                self._replace.append((s["pattern"]["String"], s.get("content", "")))
        self._reads_pieces = bool(self._byte_level or self._byte_fallback or self._replace)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._hf.id_to_token(token_id)
        if piece is None or not self._reads_pieces:
            return str(self._hf.decode([token_id], skip_special_tokens=False)).encode()
        if self._byte_level is not None:
            table = self._byte_level
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if self._byte_fallback:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        for pattern, content in self._replace:
            piece = piece.replace(pattern, content)
        return piece.encode()


def token_text(data: bytes) -> str:
    """A token's `token` field: its text, or its bytes escaped where they split a character."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return data.decode("utf-8", "backslashreplace")


class TextOffsets:
    """/v1/completions' `text_offset` across a response's tokens (and its stream's chunks): the
    characters of the text before each token; a token inside a character points at it."""

    __slots__ = ("_decoder", "chars")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def advance(self, data: bytes) -> int:
        """The offset of the token with bytes `data`; the characters it completes counted."""
        at = self.chars
        self.chars += len(self._decoder.decode(data))
        return at
