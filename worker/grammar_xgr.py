"""The grammar engine: xgrammar compiled against the worker's own tokenizer.

Loaded only through worker/grammar.py (the engine's handle, which says when each piece runs).
The pieces, in the order a constrained request meets them:
1. `GrammarBackend.for_model(dir, vocab_size, eos)` reads `tokenizer.json` with `tokenizers`
   (no transformers) into xgrammar's `TokenizerInfo`, sized to the model's vocab: ids past the
   tokenizer's (embedding padding) are empty strings, which xgrammar never allows. Added
   tokens keep their text, as `from_huggingface` has them: a structural tag's
   `{"type": "token", "token": "[TOOL_CALLS]"}` finds a special marker by it.
2. `compile(structured)` (the server calls it on a thread pool at submit): a compiled grammar,
   from an LRU cache bounded in bytes; a bad schema/regex/grammar raises `GrammarError` naming
   the wire field (the server answers INVALID_ARGUMENT).
3. `matcher(structured, stop_ids)` (the engine loop, when the request arrives): one
   `RequestGrammar` per request, closed when the request finishes, however it ends.
4. Each step the runner calls `token_mask(grammars, ...)`: every matcher first accepts the
   output tokens it has not seen (on a decode worker: the first token prefill sampled), then
   fills its row of the bitmask; `GrammarMask.apply` turns the zero bits into -inf logits in
   the sampler. After sampling, `RequestGrammar.accept` advances the matcher by the token.

Once the grammar is complete, xgrammar's mask allows only the stop tokens (the model's eos and
the request's stop ids); a terminated matcher keeps allowing only those.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
import xgrammar as xgr

from worker.sampler import GrammarViolation
from worker.sampling import GrammarError, StructuredKind, StructuredOutput
from worker.schema_support import SchemaUnsupported, check_schema, check_structural_tag

# Compiled grammars kept, in bytes (a tool-call schema is ~1 MB at a 120k-token vocabulary).
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
MAX_ERROR_CHARS = 400  # xgrammar's messages may quote the whole schema
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2.9 lowers a string with minLength/maxLength to `[^"\\\r\n]{m,n}` (upstream
# issue 800): raw control characters pass, which is invalid JSON (a strict parser refuses a
# tab). We take U+0000-U+001F out of that class, at no cost in mask time. Escapes stay
# impossible inside such a string, as upstream has them: adding `| "\\" escape` to the
# repeated element makes xgrammar's mask ~250x slower at a 120k-token vocabulary (measured).
_BOUNDED_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\x00-\x1f\"\\]'


def tokenizer_info(tokenizer_json: str, vocab_size: int,
                   stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizer.json`, with `vocab_size` rows (the model's logits).

    The vocab type (raw, byte-fallback, byte-level) and prefix-space flag come from xgrammar's
    own detector over the same JSON that `TokenizerInfo.from_huggingface` reads, so the result
    matches it without transformers (tests/worker/test_grammar.py compares the two).
    """
    tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    encoded = [""] * vocab_size  # padding rows stay "": never allowed
    vocab = tok.get_vocab(with_added_tokens=True)
    for token, idx in vocab.items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    # As from_huggingface does: when the vocabulary itself says byte-fallback or byte-level,
    # it wins over the serialized pipeline (which may have lost its decoder).
    from_vocab = xgr.TokenizerInfo._detect_vocab_type_from_vocab(vocab)
    vocab_type = from_vocab if from_vocab is not None else meta["vocab_type"]
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=[t for t in stop_token_ids if t < vocab_size] or None,
                             add_prefix_space=bool(meta["add_prefix_space"]))


def choice_ebnf(choices: Sequence[str]) -> str:
    """`root ::= "a" | "b"`: JSON string escapes (\\", \\\\, \\n, \\uXXXX) are EBNF's too."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_schema_ebnf(schema: str) -> str:
    """The schema's grammar as EBNF: compact JSON (", " and ": ", no free whitespace, so a model
    cannot loop on spaces), strict (nothing the schema does not name), bounded strings without
    raw control characters."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return grammar.replace(_BOUNDED_CHAR, _JSON_CHAR)


def _mended(compiler: xgr.GrammarCompiler, compiled: xgr.CompiledGrammar
            ) -> xgr.CompiledGrammar:
    """A structural tag's grammar with its bounded strings mended as `json_schema_ebnf`'s (its
    schemas are lowered by the same code); compiled again only when it has one (the text keeps
    token elements as `Token(id)`, which the compiler reads back)."""
    text = str(compiled.grammar)
    if _BOUNDED_CHAR not in text:
        return compiled
    return compiler.compile_grammar(text.replace(_BOUNDED_CHAR, _JSON_CHAR))


def _clean(exc: Exception) -> str:
    """xgrammar's message without its C++ location prefix, cut to a readable length."""
    text = " ".join(_XGR_PREFIX.sub("", str(exc).strip()).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class GrammarBackend:
    """One per worker: the tokenizer info, the compiler, the compiled-grammar cache and the
    count of live matchers (a drained worker holds none). Thread-safe: the server compiles on
    its thread pool while the engine loop creates, fills and closes matchers."""

    def __init__(self, info: xgr.TokenizerInfo, *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 fill_threads: int = 0) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        # xgrammar's own cache is off: this one is bounded in bytes and counts hits.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max(1, (os.cpu_count() or 2) // 2),
                                            cache_enabled=False)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.num_hits = self.num_compiles = 0
        self._num_live = 0
        threads = fill_threads or max(1, (os.cpu_count() or 2) // 2)
        self.batch_matcher = xgr.BatchGrammarMatcher(threads)  # fills many rows on its own threads

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> GrammarBackend:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise GrammarError("structured", f"this worker's model directory has no "
                               f"tokenizer.json ({path}), so it cannot compile grammars; serve a "
                               "model that ships one")
        return cls(tokenizer_info(path.read_text(), vocab_size, eos_token_ids))

    # ---- compiling (any thread) -----------------------------------------------------------------
    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); `GrammarError` naming the field when it is invalid."""
        with self._lock:
            hit = self._cache.get(structured)
            if hit is not None:
                self._cache.move_to_end(structured)
                self.num_hits += 1
                return hit
        compiled = self._compile(structured)  # outside the lock: compiles may run side by side
        with self._lock:
            self.num_compiles += 1
            if structured not in self._cache:
                self._cache[structured] = compiled
                self._cached_bytes += compiled.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes
        return compiled

    def _compile(self, s: StructuredOutput) -> xgr.CompiledGrammar:
        kind, c = s.kind, self.compiler
        try:
            if kind is StructuredKind.JSON_SCHEMA:  # a plain JSON syntax error reads better
                check_schema(json.loads(s.text))  # from here; so does an unenforced keyword
            if kind is StructuredKind.STRUCTURAL_TAG:
                check_structural_tag(json.loads(s.text))
            if kind is StructuredKind.JSON_SCHEMA:
                return c.compile_grammar(json_schema_ebnf(s.text))
            if kind is StructuredKind.JSON_OBJECT:
                return c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
            if kind is StructuredKind.REGEX:
                return c.compile_regex(s.text)
            if kind is StructuredKind.CHOICE:
                return c.compile_grammar(choice_ebnf(s.choices))
            if kind is StructuredKind.EBNF:
                return c.compile_grammar(s.text, root_rule_name="root")
            return _mended(c, c.compile_structural_tag(s.text))
        except json.JSONDecodeError as exc:
            raise GrammarError(s.field, f"is not valid JSON: {exc}") from exc
        except SchemaUnsupported as exc:
            raise GrammarError(s.field, str(exc)) from exc
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse/convert errors
            raise GrammarError(s.field, f"cannot be compiled: {_clean(exc)}") from exc

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    # ---- matchers (the engine loop) -----------------------------------------------------------
    def matcher(self, request_id: str, structured: StructuredOutput,
                stop_token_ids: Sequence[int]) -> RequestGrammar:
        """A fresh matcher for one request; it only allows a stop token once the grammar is done."""
        stops = sorted({t for t in stop_token_ids if 0 <= t < self.vocab_size})
        compiled = self.compile(structured)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        grammar = RequestGrammar(self, request_id, matcher, tuple(stops))
        with self._lock:
            self._num_live += 1
        return grammar

    @property
    def num_live(self) -> int:
        """Matchers not yet closed: 0 on a drained worker."""
        return self._num_live

    def _closed(self) -> None:
        with self._lock:
            self._num_live -= 1


class RequestGrammar:
    """One request's matcher and how many of its output tokens it has accepted."""

    def __init__(self, backend: GrammarBackend, request_id: str, matcher: xgr.GrammarMatcher,
                 stop_token_ids: tuple[int, ...]) -> None:
        self.backend = backend
        self.request_id = request_id
        self.matcher: xgr.GrammarMatcher | None = matcher  # None once closed
        self.stop_token_ids = stop_token_ids
        self.num_accepted = 0

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Accept the output tokens this matcher has not seen yet, never one twice: on a decode
        worker the first token (sampled under prefill's matcher); after a preemption, nothing."""
        assert self.num_accepted <= len(output_token_ids), "matcher ahead of the request's output"
        for token in output_token_ids[self.num_accepted :]:
            self._accept(token, "an output token this matcher had not seen")

    def accept(self, token: int) -> None:
        """Advance by the token just sampled under this matcher's mask."""
        self._accept(token, "sampled under the mask")

    def _accept(self, token: int, where: str) -> None:
        m = self.matcher
        assert m is not None, f"{self.request_id}: grammar used after close"
        if not m.is_terminated() and not m.accept_token(token):
            raise GrammarViolation(self.request_id, token, where)
        # Past termination only stop tokens are allowed (the mask says so); they change nothing.
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return self.matcher is None or self.matcher.is_terminated()

    def close(self) -> None:
        """Free the matcher (idempotent); the request finished, however it ended."""
        if self.matcher is not None:
            self.matcher = None
            self.backend._closed()


@dataclass
class GrammarMask:
    """The step's token bitmask for the sampler: bit t of row r set = token t allowed."""

    bitmask: torch.Tensor  # [B, ceil(vocab / 32)] int32 on the CPU; only `rows` are filled
    rows: list[int]  # the constrained rows of the batch

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [B, V]: disallowed tokens of the constrained rows become -inf.
        CPU: xgrammar's C++ kernel; CUDA: its Triton kernel (the bitmask is copied over)."""
        bitmask = self.bitmask
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=bitmask.is_pinned())
        width = bitmask.shape[1] * 32
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(width, logits.shape[1]),
                                        indices=self.rows)
        if logits.shape[1] > width:  # wider logits than the mask: that padding is never allowed
            logits[self.rows, width:] = float("-inf")


def token_mask(grammars: Sequence[RequestGrammar | None], outputs: Sequence[Sequence[int]],
               banned: Sequence[Sequence[int]]) -> GrammarMask:
    """Fill the bitmask rows of the constrained requests (`grammars[i]` not None).

    `outputs[i]`: the request's output so far (the matcher catches up on it first);
    `banned[i]`: stop ids min_tokens still bans. They are cleared from the row unless nothing
    else is left: then the grammar wins (it must end, so min_tokens cannot be honoured).
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    backend = grammars[rows[0]].backend  # type: ignore[union-attr]  # one per worker
    # Pinned on CUDA hosts so the copy to the device is asynchronous (torch caches the pages).
    bitmask = torch.full(xgr.get_bitmask_shape(len(grammars), backend.vocab_size), -1,
                         dtype=torch.int32, pin_memory=torch.cuda.is_available())
    live: list[xgr.GrammarMatcher] = []
    live_rows: list[int] = []
    words = bitmask.numpy().view(np.uint32)  # [B, W] shares the tensor's memory
    for i in rows:
        g = grammars[i]
        assert g is not None
        g.catch_up(outputs[i])
        if g.terminated:  # it accepted a stop token (ignore_eos goes on): only stops remain
            words[i] = 0
            _set_bits(words[i], g.stop_token_ids)
        else:
            assert g.matcher is not None
            live.append(g.matcher)
            live_rows.append(i)
    if len(live) == 1:
        live[0].fill_next_token_bitmask(bitmask, live_rows[0])
    elif live:
        backend.batch_matcher.batch_fill_next_token_bitmask(live, bitmask, live_rows)
    for i in rows:
        if banned[i]:
            _clear_bits_unless_empty(words[i], banned[i])
    return GrammarMask(bitmask, rows)


def _set_bits(row: np.ndarray, ids: Sequence[int]) -> None:
    for t in ids:
        row[t >> 5] |= np.uint32(1 << (t & 31))


def _clear_bits_unless_empty(row: np.ndarray, ids: Sequence[int]) -> None:
    kept = row.copy()
    for t in ids:
        if (t >> 5) < kept.shape[0]:
            kept[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    if kept.any():
        row[:] = kept
