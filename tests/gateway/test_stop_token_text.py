"""The token that ends an output as a stop token (the model's eos, unless ignore_eos, or one of
`stop_token_ids`) is counted (usage, token_ids, logprobs) but its text is not output, as vLLM
and SGLang answer: with `skip_special_tokens: false` every answer ended in `<|im_end|>`, and a
plain stop token id (a newline, say) stayed at the end of the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.openai_types import CompletionRequest
from gateway.output import assemblers_for
from gateway.session import Output
from gateway.tokenizer import Tokenizer

EOS = "<|im_end|>"


def _text(tok: Tokenizer, req: CompletionRequest, ids: list[int], finish: str,
          eos_ids: frozenset[int]) -> tuple[str, int]:
    """The text (streamed a token a message) and completion tokens of an output of `ids`."""
    out, _ = assemblers_for(tok, req, None, tok.encode("hi"), eos_ids)()
    text = ""
    for n, i in enumerate(ids):
        msg = Output([i], [])
        msg.finish_reason = finish if n == len(ids) - 1 else ""
        text += out.add(msg)
    return text, out.completion_tokens


@pytest.mark.parametrize("skip", [True, False])
def test_the_eos_that_ends_an_output_is_counted_not_written(tok_dir: Path, skip: bool) -> None:
    tok = Tokenizer.from_dir(tok_dir)
    eos = tok.token_id(EOS)
    assert eos is not None
    hello = tok.encode("hello world", add_special_tokens=False)
    req = CompletionRequest(prompt="hi", skip_special_tokens=skip)
    assert _text(tok, req, [*hello, eos], "stop", frozenset({eos})) == (
        "hello world", len(hello) + 1)
    # ignore_eos: an eos is text like any token (special: shown only when not skipped)
    req = CompletionRequest(prompt="hi", skip_special_tokens=skip, ignore_eos=True)
    shown = "" if skip else EOS
    assert _text(tok, req, [*hello, eos], "length", frozenset({eos}))[0] == "hello world" + shown
    # a stop_token_ids entry that is a plain token
    comma = tok.encode(",", add_special_tokens=False)
    req = CompletionRequest(prompt="hi", skip_special_tokens=skip, stop_token_ids=comma)
    assert _text(tok, req, [*hello, *comma], "stop", frozenset({eos})) == (
        "hello world", len(hello) + 1)
