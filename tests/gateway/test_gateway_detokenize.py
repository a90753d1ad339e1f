"""Incremental detokenizer on multi-byte text and stop strings across chunk boundaries."""

from __future__ import annotations

import itertools

import pytest

from gateway.detokenize import IncrementalDetokenizer, StopStringMatcher
from gateway.tokenizer import Tokenizer

TEXTS = ["héllo 🙂 wörld", "日本語のテキスト and 🚀 rockets", "plain ascii text here", "ü🙂🚀日"]


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_equals_full_decode(tok, text, step):
    ids = tok.encode(text, add_special_tokens=False)
    assert (
        any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    )  # tokens split characters
    detok = IncrementalDetokenizer(tok, prompt_tail=tok.encode("prompt "))
    deltas = [detok.step(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_incomplete_character_is_held_then_flushed(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids[:1]) == ""
    assert detok.flush() == "\ufffd"  # the end of the stream releases what is left


def test_skip_special_tokens(tok):
    ids = (
        tok.encode("hello", add_special_tokens=False)
        + [2]
        + tok.encode(" world", add_special_tokens=False)
    )
    for skip, expected in ((True, "hello world"), (False, "hello<|im_end|> world")):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(detok.step([i]) for i in ids) + detok.flush()
        assert out == expected


@pytest.mark.parametrize("stops", [["STOP"], ["xyz", "OP h"], ["a"], ["here and"]])
def test_stop_string_every_split(stops):
    text = "one two STOP here and more"
    cut = min((text.find(s) for s in stops if s in text), default=len(text))
    for i, j in itertools.combinations(range(1, len(text)), 2):  # every 3-way split of the text
        m = StopStringMatcher(stops)
        out = m.feed(text[:i]) + m.feed(text[i:j]) + m.feed(text[j:])
        out += m.flush()
        assert out == text[:cut], (i, j)
        assert m.stopped is (cut < len(text))


def test_stop_holdback_is_released_at_end():
    m = StopStringMatcher(["STOPPER"])
    assert m.feed("abc STO") == "abc "  # "STO" could be the start of the stop string
    assert m.feed("P") == ""
    assert m.flush() == "STOP"
    assert not m.stopped
