"""`min_tokens` holds stop strings too: none may end within the first min_tokens tokens, as vLLM
(its detokenizer checks stop strings only past min_tokens) and SGLang (`check_finished` returns
before any stop check) answer. The worker bans the eos and stop ids that long; the gateway
matched stop strings from the first token, so `min_tokens: 12, stop: [";"]` ended after 10
tokens with finish_reason "stop". Found driving a live cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.detokenize import StopStringMatcher
from gateway.openai_types import CompletionRequest
from gateway.output import assemblers_for
from gateway.session import Output
from gateway.tokenizer import Tokenizer

TEXT = "ab;cd;ef"


def _run(tok: Tokenizer, stop: str, min_tokens: int, per: int) -> tuple[str, str, int]:
    """TEXT a character a token, `per` tokens a worker message: (text, finish, tokens)."""
    ids = [tok.encode(ch, add_special_tokens=False) for ch in TEXT]
    assert all(len(i) == 1 for i in ids)
    flat = [i[0] for i in ids]
    req = CompletionRequest(prompt="x", stop=[stop], min_tokens=min_tokens)
    out, _ = assemblers_for(tok, req, None, tok.encode("x"))()
    text = ""
    for k in range(0, len(flat), per):
        msg = Output(flat[k:k + per], [])
        msg.finish_reason = "length" if k + per >= len(flat) else ""
        text += out.add(msg)
        if out.finished:
            break
    assert out.finish_reason is not None
    return text, out.finish_reason, out.completion_tokens


@pytest.mark.parametrize("per", [1, 3, 8])
@pytest.mark.parametrize(("stop", "min_tokens", "want"), [
    (";", 0, ("ab", "stop", 3)),
    (";", 2, ("ab", "stop", 3)),  # the first ";" is token 3: past min_tokens
    (";", 3, ("ab;cd", "stop", 6)),  # token 3 is within min_tokens: the next ";" stops it
    (";", 6, (TEXT, "length", 8)),  # neither may stop it
    ("b;c", 3, ("a", "stop", 4)),  # it ends in token 4
    ("b;c", 4, (TEXT, "length", 8)),
    (";c", 3, ("ab", "stop", 4)),  # starts within min_tokens, ends past it: it stops
])
def test_no_stop_string_ends_within_min_tokens(tok_dir: Path, stop: str, min_tokens: int,
                                               want: tuple[str, str, int], per: int) -> None:
    assert _run(Tokenizer.from_dir(tok_dir), stop, min_tokens, per) == want


def test_an_unarmed_delta_is_released_but_for_a_stop_prefix() -> None:
    m = StopStringMatcher(["xyz", "q"])
    assert m.feed("aqbx", armed=False) == "aqb"  # "q" is a whole stop, not matched; "x" held
    assert not m.stopped
    assert m.feed("yz") == "" and m.stopped  # "xyz" ends in an armed delta
    m = StopStringMatcher(["ab", "b"])
    assert m.feed("xab", armed=False) == "xa"  # "b" held: it starts "b"
    assert m.feed("c") == "bc" and not m.stopped  # that "b" ended unarmed: not a stop
