"""A streamed token with no parser, stop string or dropped id takes a shorter path through
`StreamEvents.of` (OutputAssembler.add's and the chat events' plain case); its events are the
general path's, byte for byte, whatever the text (characters split over tokens held back),
with or without logprobs, up to the finishing output."""

from __future__ import annotations

import json

import pytest

from gateway.agents import ChatPlan
from gateway.chat_output import ChatOutput
from gateway.metrics import LoopHistogram, TokenClock
from gateway.output import OutputAssembler
from gateway.session import Output
from gateway.streaming import StreamEvents
from gateway.tokenizer import Tokenizer
from protocol import tandem_pb2

TEXT = "Hello wörld 🎉 naïve 日本 ok. " * 3


def _events(tok: Tokenizer, chat: bool, logprobs: bool, plain: bool
            ) -> tuple[StreamEvents, OutputAssembler]:
    out = OutputAssembler(tok, [1, 2, 3], True, [], 0 if logprobs else -1)
    chat_out = ChatOutput(ChatPlan(prompt_ids=[1, 2, 3])) if chat else None
    assert out.plain and (chat_out is None or chat_out.plain)
    out.plain = plain
    if chat_out is not None:
        chat_out.plain = plain
    clock = TokenClock(LoopHistogram("i", "", [1.0]), 1)
    return StreamEvents("r", "tiny", out, chat_out, clock, created=0), out


def _outputs(ids: list[int], logprobs: bool, per: int) -> list[Output]:
    outs = []
    for i in range(0, len(ids), per):
        chunk = ids[i:i + per]
        lps = [tandem_pb2.TokenLogprob(token_id=t, logprob=-0.25,
                                       top=[tandem_pb2.TopLogprob(token_id=t, logprob=-0.25)])
               for t in chunk] if logprobs else []
        outs.append(Output(chunk, lps))
    outs[-1].finish_reason = "length"
    return outs


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("per", [1, 3])
def test_plain_path_events_equal_the_general_paths(tok_dir, chat, logprobs, per):
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode(TEXT, add_special_tokens=False)
    (fast, fast_out), (general, general_out) = (_events(tok, chat, logprobs, plain)
                                                for plain in (True, False))
    got = [fast.of(o) for o in _outputs(ids, logprobs, per)]
    want = [general.of(o) for o in _outputs(ids, logprobs, per)]
    assert got == want
    for out in (fast_out, general_out):  # usage, token ids and logprobs counted alike
        assert (out.completion_tokens, out.token_ids) == (len(ids), ids)
        assert len(out.logprobs) == (len(ids) if logprobs else 0)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # characters split over tokens
    assert b"".join(b"".join(e) for e in got).count(b"data: ") >= len(ids) // per // 2


def test_streamed_text_offsets_are_the_non_streamed_ones_when_a_stop_string_holds_text(tok_dir):
    """A completion's logprobs.text_offset counts every earlier token's text, as the
    non-streamed answer's does, also while a possible stop string holds text back (the stream
    gave [0, 1, 1, 3, ...] where the answer gave [0, 1, 2, 3, ...])."""
    tok = Tokenizer.from_dir(tok_dir)
    ids = tok.encode(" a=b c=d e", add_special_tokens=False)
    out = OutputAssembler(tok, [1, 2, 3], True, ["=x"], 0)
    stream = StreamEvents("r", "tiny", out, None, TokenClock(LoopHistogram("i", "", [1.0]), 1),
                          created=0)
    offsets = []
    for o in _outputs(ids, True, 1):
        for event in stream.of(o):
            choice = json.loads(event[len(b"data: "):])["choices"][0]
            offsets += (choice["logprobs"] or {}).get("text_offset", [])
    assert len(offsets) == len(ids)
    assert offsets == out.completion_logprobs(out.logprobs).text_offset
