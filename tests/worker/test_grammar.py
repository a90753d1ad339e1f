"""The grammar engine on its own (worker/grammar_xgr.py): tokenizer info from tokenizer.json,
compiling and caching, the per-step bitmask, and the sampler applying it (no model here)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from tests.worker.grammar_tokenizers import byte_fallback_bpe, byte_level_bpe, embedded
from worker.grammar import GrammarError
from worker.grammar_xgr import (
    GrammarBackend,
    GrammarMask,
    RequestGrammar,
    token_mask,
    tokenizer_info,
)
from worker.sampler import GrammarViolation, Sampler
from worker.sampling import SamplingParams, StructuredKind, StructuredOutput

# name -> (tokenizer, eos text); each padded by 37 ids past the tokenizer, like a model's embedding.
TOKENIZERS = {"embedded": (embedded, "<|endoftext|>"),
              "byte_level": (byte_level_bpe, "<|endoftext|>"),
              "byte_fallback": (byte_fallback_bpe, "</s>")}
PAD = 37

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": -50, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
}, "required": ["name", "n", "tags"]}


def backend_for(name: str, **kwargs: int) -> tuple[GrammarBackend, Tokenizer, int]:
    make, eos_text = TOKENIZERS[name]
    tok = make()
    eos = tok.token_to_id(eos_text)
    vocab = tok.get_vocab_size(with_added_tokens=True) + PAD
    return GrammarBackend(tokenizer_info(tok.to_str(), vocab, [eos]), **kwargs), tok, eos


def allowed(grammar: RequestGrammar, output: list[int] | None = None) -> list[int]:
    """The tokens the next mask allows; `output`: what the request produced so far."""
    so_far = output if output is not None else [0] * grammar.num_accepted
    mask = token_mask([grammar], [so_far], [[]])
    bits = mask.bitmask[0]
    return [t for t in range(grammar.backend.vocab_size) if (int(bits[t >> 5]) >> (t & 31)) & 1]


def walk(grammar: RequestGrammar, eos: int, rng: random.Random, max_steps: int = 400) -> list[int]:
    """A random path through the grammar: any allowed token, eos only when nothing else is."""
    out: list[int] = []
    for _ in range(max_steps):
        ok = allowed(grammar, out)
        choices = [t for t in ok if t != eos] or ok
        token = rng.choice(choices)
        if token == eos:
            return out
        grammar.accept(token)
        out.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_tokenizer_info_matches_from_huggingface(name: str) -> None:
    """Built from tokenizer.json with `tokenizers` alone, it is what xgrammar's transformers
    path builds: vocabulary type, prefix space, stop tokens and every decoded token."""
    make, eos_text = TOKENIZERS[name]
    tok = make()
    vocab = tok.get_vocab_size(with_added_tokens=True) + PAD
    eos = tok.token_to_id(eos_text)
    ours = tokenizer_info(tok.to_str(), vocab, [eos])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_text)
    theirs = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    assert (ours.vocab_type, ours.add_prefix_space, ours.vocab_size) == (
        theirs.vocab_type, theirs.add_prefix_space, theirs.vocab_size)
    assert ours.stop_token_ids == theirs.stop_token_ids == [eos]
    assert ours.decoded_vocab == theirs.decoded_vocab
    assert ours.special_token_ids == theirs.special_token_ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_random_walks_decode_to_text_the_grammar_accepts(name: str) -> None:
    """Any path the masks allow, decoded by the real tokenizer, matches: the byte-level and
    byte-fallback pieces are understood as the tokenizer means them."""
    backend, tok, eos = backend_for(name)
    rng = random.Random(0)
    regex = r"(id-[0-9]{2}|[a-c]{1,3}) (yes|no);"
    for _ in range(5):
        out = walk(backend.matcher("r", StructuredOutput(StructuredKind.REGEX, regex), [eos]),
                   eos, rng)
        assert re.fullmatch(regex, tok.decode(out, skip_special_tokens=False)), tok.decode(out)
        schema = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
        out = walk(backend.matcher("j", schema, [eos]), eos, rng)
        value = json.loads(tok.decode(out, skip_special_tokens=False))
        assert set(value) == {"name", "n", "tags"} and -50 <= value["n"] <= 50


def test_padding_is_never_allowed_and_a_token_element_finds_a_special_token() -> None:
    """Embedding rows past the tokenizer are never sampled; a structural tag's token element
    (how the gateway writes a special marker such as Mistral's [TOOL_CALLS]) finds the
    special token by its text."""
    backend, tok, eos = backend_for("embedded")
    real = tok.get_vocab_size(with_added_tokens=True)
    assistant = tok.token_to_id("<|assistant|>")
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "<|assistant|>"}, {"type": "any_text"}]}}
    grammar = backend.matcher("t", StructuredOutput(StructuredKind.STRUCTURAL_TAG, json.dumps(tag)),
                              [eos])
    assert allowed(grammar) == [assistant]
    grammar.accept(assistant)
    ok = set(allowed(grammar, [assistant]))  # free text now: everything a text may hold...
    assert ok.isdisjoint(set(range(real, real + PAD)))  # ...but no embedding padding
    assert {eos, tok.token_to_id("a")} <= ok


@pytest.mark.parametrize(("structured", "fragment"), [
    (StructuredOutput(StructuredKind.JSON_SCHEMA, "{bad"), "not valid JSON"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "frobnicate"}'), "cannot be compiled"),
    (StructuredOutput(StructuredKind.REGEX, "(abc"), "parenthesis"),
    (StructuredOutput(StructuredKind.EBNF, "root ::= missing"), 'Rule "missing" is not defined'),
    (StructuredOutput(StructuredKind.EBNF, 'start ::= "a"'), "root"),
    (StructuredOutput(StructuredKind.STRUCTURAL_TAG, "{}"), "format"),
    (StructuredOutput(StructuredKind.STRUCTURAL_TAG, "[1,"), "not valid JSON"),
])
def test_invalid_grammars_name_their_field(structured: StructuredOutput, fragment: str) -> None:
    backend, _, _ = backend_for("embedded")
    with pytest.raises(GrammarError) as err:
        backend.compile(structured)
    assert err.value.field == structured.field
    message = str(err.value)
    assert message.startswith(f"sampling.{structured.field}: ") and fragment in message
    assert "/project/cpp" not in message and len(message) < 500  # no C++ location, no schema dump


def test_compiled_grammars_are_cached_and_the_cache_is_bounded() -> None:
    backend, _, eos = backend_for("embedded")
    regex = [StructuredOutput(StructuredKind.REGEX, f"a{{{n}}}") for n in range(1, 6)]
    first = backend.compile(regex[0])
    assert backend.compile(regex[0]) is first and (backend.num_compiles, backend.num_hits) == (1, 1)
    backend.matcher("m", regex[0], [eos]).close()  # a matcher reuses the cached grammar too
    assert backend.num_compiles == 1
    small, _, _ = backend_for("embedded", cache_bytes=2 * first.memory_size_bytes)
    for s in regex:
        small.compile(s)
    assert small.num_cached < len(regex)
    assert small.cached_bytes <= small.cache_bytes or small.num_cached == 1  # the newest stays
    small.compile(regex[0])  # evicted (least recently used): compiled again
    assert small.num_compiles == len(regex) + 1


def test_choice_is_exactly_one_of_the_strings() -> None:
    backend, tok, eos = backend_for("byte_level")
    choices = ('say "hi"', "back\\slash", "two\nlines", "café", "")
    rng = random.Random(1)
    seen = set()
    for _ in range(40):
        choice = StructuredOutput(StructuredKind.CHOICE, choices=choices)
        out = walk(backend.matcher("c", choice, [eos]), eos, rng)
        seen.add(tok.decode(out, skip_special_tokens=False))
    assert seen <= set(choices) and len(seen) >= 3


def test_once_complete_only_stop_tokens_and_after_a_stop_still_only_stops() -> None:
    backend, tok, eos = backend_for("embedded")
    semi = tok.token_to_id(";")
    grammar = backend.matcher("s", StructuredOutput(StructuredKind.REGEX, "ab"), [eos, semi, 9999])
    assert grammar.stop_token_ids == (eos, semi)  # ids outside the vocabulary are dropped
    for ch in "ab":
        grammar.accept(tok.token_to_id(ch))
    assert allowed(grammar) == sorted([eos, semi])
    grammar.accept(eos)  # ignore_eos: the request goes on, the matcher has terminated
    assert grammar.terminated and allowed(grammar) == sorted([eos, semi])
    grammar.accept(eos)
    grammar.close()
    grammar.close()  # idempotent
    assert backend.num_live == 0


def test_a_refused_token_raises_and_catch_up_never_feeds_twice() -> None:
    backend, tok, eos = backend_for("embedded")
    grammar = backend.matcher("v", StructuredOutput(StructuredKind.REGEX, "abc"), [eos])
    ids = [tok.token_to_id(c) for c in "abc"]
    grammar.catch_up(ids[:1])  # a decode worker: the first token came from prefill
    grammar.catch_up(ids[:1])  # nothing new: nothing fed
    grammar.accept(ids[1])
    grammar.catch_up(ids[:2])
    assert grammar.num_accepted == 2 and allowed(grammar, ids[:2]) == [ids[2]]
    with pytest.raises(AssertionError, match="ahead"):
        grammar.catch_up(ids[:1])  # an output shorter than what was fed: never silently
    with pytest.raises(GrammarViolation, match="token"):
        grammar.accept(tok.token_to_id("z"))


def test_min_tokens_ban_yields_only_when_the_grammar_must_end() -> None:
    backend, tok, eos = backend_for("embedded")
    a = tok.token_to_id("a")
    can_go_on = backend.matcher("x", StructuredOutput(StructuredKind.REGEX, "a+"), [eos])
    must_end = backend.matcher("y", StructuredOutput(StructuredKind.REGEX, "a"), [eos])
    can_go_on.accept(a)
    must_end.accept(a)
    mask = token_mask([can_go_on, None, must_end], [[a], [], [a]], [[eos], [eos], [eos]])
    assert mask.rows == [0, 2]
    logits = torch.zeros(3, backend.vocab_size)
    mask.apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [a]  # eos banned, "a" goes on
    assert torch.isfinite(logits[1]).all()  # unconstrained row untouched
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [eos]  # the grammar wins


def test_mask_covers_logits_wider_than_the_tokenizer() -> None:
    bitmask = torch.full((2, 1), -1, dtype=torch.int32)  # 32 tokens allowed
    bitmask[1, 0] = 1 << 5  # row 1: token 5 only
    logits = torch.randn(2, 40)
    GrammarMask(bitmask, [1]).apply(logits)
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5]


def test_sampler_masks_rows_biases_and_keeps_masked_tokens_out_of_top_logprobs() -> None:
    vocab = 64
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = (1 << 3) | (1 << 7)  # row 0 may only say 3 or 7
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 3], logits[0, 7], logits[0, 9] = 1.0, 2.0, 50.0
    greedy = SamplingParams(temperature=0.0, top_logprobs=4)
    biased = SamplingParams(temperature=0.0, logit_bias=((11, 100.0),))
    hot = SamplingParams(temperature=1.5, seed=1, logit_bias=((int(logits[2].argmax()), -100.0),))
    gens = [None, None, torch.Generator().manual_seed(1)]
    out = Sampler().sample(logits, [greedy, biased, hot], gens, [[], [], []], [0, 0, 0], (0,),
                           GrammarMask(bitmask, [0]))
    assert out.token_ids[:2] == [7, 11] and out.token_ids[2] != int(logits[2].argmax())
    assert out.top_logprobs is not None and [t for t, _ in out.top_logprobs[0]] == [7, 3]
    mass = torch.tensor([v for _, v in out.top_logprobs[0]]).exp().sum()
    assert float(mass) == pytest.approx(1.0)


def test_length_bounded_json_strings_refuse_raw_control_characters() -> None:
    """xgrammar 0.2.9's minLength/maxLength strings (its issue 800) as mended here: a raw tab
    would be invalid JSON (strict parsers refuse it)."""
    backend, tok, eos = backend_for("embedded")
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
              "required": ["s"]}
    bounded = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    grammar = backend.matcher("b", bounded, [eos])
    out = [tok.token_to_id(c) for c in '{"s": "a']
    for t in out:
        grammar.accept(t)
    ok = allowed(grammar, out)
    assert not {tok.token_to_id(c) for c in "\t\n\r"} & set(ok)
    assert {tok.token_to_id(c) for c in "b ~"} <= set(ok)
    for c in 'b "}':  # "ab ": three characters, the bound
        grammar.accept(tok.token_to_id(c))
        out.append(tok.token_to_id(c))
    assert allowed(grammar, out) == [eos]
    assert json.loads(tok.decode(out)) == {"s": "ab "}


def test_length_bounded_strings_inside_a_structural_tag_refuse_raw_control_characters() -> None:
    """The same mend for a schema inside a structural tag (a forced or strict tool call's
    arguments, a response_format behind an open think block): the tag was compiled as
    xgrammar lowered it, so a tab passed into a bounded string there (invalid JSON)."""
    backend, tok, eos = backend_for("embedded")
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
              "required": ["s"]}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "<|assistant|>"},  # read back from the mended text too
        {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": schema},
         "end": "</a>"}]}}
    grammar = backend.matcher("t", StructuredOutput(StructuredKind.STRUCTURAL_TAG,
                                                    json.dumps(tag)), [eos])
    assistant = tok.token_to_id("<|assistant|>")
    assert allowed(grammar) == [assistant]
    out = [assistant, *tok.encode('<a>{"s": "a', add_special_tokens=False).ids]
    for t in out:
        grammar.accept(t)
    ok = set(allowed(grammar, out))
    assert not {tok.token_to_id(c) for c in "\t\n\r"} & ok
    assert {tok.token_to_id(c) for c in "b ~"} <= ok
