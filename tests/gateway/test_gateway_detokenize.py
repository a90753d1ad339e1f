"""Incremental detokenizer on multi-byte text and stop strings across chunk boundaries."""

from __future__ import annotations

import itertools
from typing import Any

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


class _Wrapped:
    """A bare tokenizers.Tokenizer as the gateway's Tokenizer presents it."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback", "embedded"])
def test_every_tokenizer_kind_streams_what_the_whole_decodes_to(kind):
    """Deltas after a prompt's tail join to the text the tail plus the output decodes to past
    the tail (the leading space a SentencePiece decoder keeps only in context included)."""
    from tokenizers import Tokenizer as HF

    from tests.worker.grammar_tokenizers import EMBEDDED, byte_fallback_bpe, byte_level_bpe

    hf = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe,
          "embedded": lambda: HF.from_file(str(EMBEDDED))}[kind]()
    tok = _Wrapped(hf)
    texts = ["héllo 🙂 wörld", " leading space", "Ünïcödé ∑ 東京 naïve café", "a=12;b=34;"]
    for text, prompt, skip in itertools.product(texts, ["", "prompt", "x 🙂", "end "],
                                                [True, False]):
        ids = hf.encode(text, add_special_tokens=False).ids
        tail = hf.encode(prompt, add_special_tokens=False).ids[-IncrementalDetokenizer.CONTEXT:]
        detok = IncrementalDetokenizer(tok, skip, tail)
        deltas = [detok.step([i]) for i in ids]
        got = "".join(deltas) + detok.flush()
        before = tok.decode(tail, skip)
        assert got == tok.decode(tail + ids, skip)[len(before):], (text, prompt, deltas)


class _Refusing:
    """A DecodeStream that raises on its n-th step (1-based), as tokenizers does on a window
    whose text no longer starts with what it gave."""

    def __init__(self, real: Any, n: int) -> None:
        self.real, self.n, self.calls = real, n, 0

    def step(self, hf: Any, i: int) -> str | None:
        self.calls += 1
        if self.calls == self.n:
            raise Exception("Invalid prefix encountered")  # tokenizers' bare Exception
        return self.real.step(hf, i)  # type: ignore[no-any-return]


def test_a_refused_step_restarts_the_stream_and_loses_nothing(tok):
    """The detokenizer starts a new stream after the last token that gave text and replays the
    held ones: the text is the same whichever step was refused."""
    ids = tok.encode("héllo 🙂 wörld", add_special_tokens=False)
    plain = IncrementalDetokenizer(tok)
    want = "".join(plain.step([i]) for i in ids) + plain.flush()
    assert want == "héllo 🙂 wörld"
    for n in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok)
        detok._stream = _Refusing(detok._stream, n)  # type: ignore[assignment]
        got = [detok.step([i]) for i in ids]
        assert "".join(got) + detok.flush() == want, (n, got)
        assert not isinstance(detok._stream, _Refusing)


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


def test_usage_counts_every_prompt_token_when_a_parser_keeps_some_specials() -> None:
    """A parser that reads a special token (keep_token_ids) makes the assembler drop the other
    specials from the prompt tail it detokenizes against; usage still counts all of them (the
    worker read them all)."""
    from gateway.output import OutputAssembler
    from orchestrator.launch.background import EMBEDDED_MODEL

    tok = Tokenizer.from_dir(str(EMBEDDED_MODEL))
    prompt = tok.encode("<|user|>a,t?<|assistant|>", add_special_tokens=False)
    specials = [t for t in prompt if t in tok.special_ids]
    assert len(specials) >= 2  # the chat markers are special tokens of this tokenizer
    keep = frozenset({next(iter(tok.special_ids - set(prompt)))})  # e.g. a tool-call marker
    out = OutputAssembler(tok, prompt, True, [], -1, keep_token_ids=keep)
    assert out.num_prompt_tokens == len(prompt)
    assert OutputAssembler(tok, prompt, True, [], -1).num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("per_token", [False, True])
def test_a_stop_string_ends_usage_token_ids_and_logprobs_at_its_token(per_token: bool) -> None:
    """Tokens a message carries past the one that completes a stop string are not output: the
    counts equal those of one token a message (PD's decode worker may bundle its first two)."""
    from gateway.output import OutputAssembler
    from gateway.session import Output
    from orchestrator.launch.background import EMBEDDED_MODEL
    from protocol import tandem_pb2

    tok = Tokenizer.from_dir(str(EMBEDDED_MODEL))
    ids = tok.encode("12;34;56", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if ";" in tok.decode(ids[: i + 1])) + 1

    def assembled(messages: list[list[int]]) -> OutputAssembler:
        out = OutputAssembler(tok, tok.encode("q?", add_special_tokens=False), True, [";"], 0)
        for chunk in messages:
            lp = [tandem_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in chunk]
            out.add_token_pieces(Output(chunk, lp), per_token=per_token)
            if out.finished:
                break
        return out

    bundled, single = assembled([ids]), assembled([[t] for t in ids])
    for out in (bundled, single):
        assert out.finish_reason == "stop"
        assert out.completion_tokens == stop_at and out.token_ids == ids[:stop_at]
        assert [e.token_id for e in out.logprobs] == ids[:stop_at]


def test_byte_pieces_that_regroup_into_invalid_utf8_never_raise() -> None:
    """A byte-fallback tokenizer (Llama-2 / Mistral) decodes a run of `<0xNN>` pieces that is not
    valid UTF-8 as one U+FFFD per byte, the valid ones before it included: an ASCII byte piece
    that already went out as "{" becomes "�" once an orphan lead byte follows, so the restart's
    own window (after that piece) is refused too. A random-weight model sampled this and the
    gateway answered 500; now the stream goes on from a fresh window and loses no later text."""
    from tests.worker.grammar_tokenizers import byte_fallback_bpe

    tok = _Wrapped(byte_fallback_bpe())
    piece = tok.hf.token_to_id
    word = tok.hf.encode("hello", add_special_tokens=False).ids
    ids = [piece("<0x7B>"), piece("<0xE6>"), piece("<0x97>"), *word]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip, tok.hf.encode("prompt").ids)
        got = "".join(detok.step([i]) for i in ids) + detok.flush()
        assert got.startswith("{") and got.endswith("hello"), got


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_prompt_that_ends_inside_a_character_never_leaks_into_the_output(kind: str) -> None:
    """A token-id prompt may end inside a character (its first bytes); DecodeStream primed with
    such ids gave the whole context's text with the first output ('ab 🙂' for a prompt 'ab 🙂'
    cut after 🙂's first byte): the prompt's text in the completion. The output now starts with
    the character it completes, and after that is what the whole decodes to."""
    from tests.worker.grammar_tokenizers import byte_fallback_bpe, byte_level_bpe

    hf = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe}[kind]()
    tok = _Wrapped(hf)
    ids = hf.encode("ab 🙂 cd", add_special_tokens=False).ids
    for cut in range(1, len(ids)):
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, skip, ids[:cut])
            got = "".join(detok.step([i]) for i in ids[cut:]) + detok.flush()
            assert "ab" not in got, (cut, got)
            whole = tok.decode(ids, skip)
            assert got.endswith("d") and whole.endswith(got), (cut, got)
