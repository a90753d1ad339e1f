"""Logprobs' `token` and `bytes` as the OpenAI API documents them, on the tokenizer families
real checkpoints ship: `bytes` are the token's own UTF-8 bytes, so the tokens' bytes joined are
the output text even where a character spans tokens (an emoji of byte-level or `<0xNN>` pieces)
and where a SentencePiece piece starts a word ("▁world" is " world", not the "world" that
decoding the piece alone gives). A token that is a whole UTF-8 sequence is its text; one that
is not is its bytes escaped (`\\xf0\\x9f`, as DeepSeek's API writes it), never U+FFFD.
`/v1/completions`' tokens join to the text, and `text_offset` counts the characters before each
token (a token inside a character points at that character)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HF

from gateway.detokenize import IncrementalDetokenizer
from gateway.output import OutputAssembler
from gateway.token_bytes import TextOffsets
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2
from tests.worker.grammar_tokenizers import byte_fallback_bpe, byte_level_bpe, embedded

KINDS = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe, "embedded": embedded}
TEXT = {"byte_level": " hello 東京 🙂 café e\u0301!", "byte_fallback": " hello world 🙂 東京 x",
        "embedded": "a=12;b=34;"}


def _case(kind: str) -> tuple[Tokenizer, list[int], str]:
    """A tokenizer, an output's ids after the prompt "q", and the text a client streams."""
    hf: HF = KINDS[kind]()
    tok = Tokenizer(hf, {})
    ids = hf.encode(TEXT[kind], add_special_tokens=False).ids
    prompt = hf.encode("q", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, True, prompt)
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    return tok, ids, text


def _entries(ids: list[int], rival: int) -> list[tandem_pb2.TokenLogprob]:
    return [tandem_pb2.TokenLogprob(token_id=i, logprob=-0.5, top=[
        tandem_pb2.TopLogprob(token_id=rival, logprob=-0.25)]) for i in ids]


@pytest.mark.parametrize("kind", list(KINDS))
def test_chat_logprob_bytes_join_to_the_text(kind: str) -> None:
    tok, ids, text = _case(kind)
    assert kind == "embedded" or len(text.encode()) > len(text)  # multi-byte characters
    out = OutputAssembler(tok, [], True, [], 1)
    content = out.chat_logprobs(_entries(ids, ids[-1])).content
    got = [bytes(e.bytes or []) for e in content]
    assert b"".join(got) == text.encode(), got
    for e, b in zip(content, got, strict=True):
        try:
            assert e.token == b.decode()
        except UnicodeDecodeError:
            assert e.token == b.decode("utf-8", "backslashreplace"), e.token
        assert "\ufffd" not in e.token
        assert e.top_logprobs[0].bytes == content[-1].bytes
    if kind != "embedded":
        assert any("\\x" in e.token for e in content)  # some token splits a character


@pytest.mark.parametrize("kind", list(KINDS))
def test_completion_tokens_and_offsets_follow_the_text(kind: str) -> None:
    tok, ids, text = _case(kind)
    out = OutputAssembler(tok, [], True, [], 1)
    lp = out.completion_logprobs(_entries(ids, ids[-1]))
    content = out.chat_logprobs(_entries(ids, ids[-1])).content
    assert lp.tokens == [e.token for e in content]
    done = b""
    for off, e in zip(lp.text_offset, content, strict=True):
        assert off == len(done.decode("utf-8", "ignore")), (off, done)
        done += bytes(e.bytes or [])
    # Streamed a few tokens a chunk, the offsets carry on from the chunk before.
    streamed: list[int] = []
    offsets = TextOffsets()
    for i in range(0, len(ids), 3):
        streamed += out.completion_logprobs(_entries(ids[i:i + 3], ids[-1]), offsets).text_offset
    assert streamed == lp.text_offset
