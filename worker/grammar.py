"""The engine's handle on grammar-constrained decoding (the grammar engine: worker/grammar_xgr.py).

Kept free of xgrammar: importing it pulls transformers (~0.5 s, and its memory), so a worker
loads it only when the first request with `sampling.structured` arrives.

Lifecycle of a constrained request's grammar:
1. Submit (server thread pool): `Grammars.compile` compiles `sampling.structured` against the
   worker's tokenizer, or refuses it with a `GrammarError` naming the field (INVALID_ARGUMENT).
2. Arrival (engine loop): `Grammars.attach` gives the request its own matcher
   (`request.grammar`); the compiled grammar comes from the cache.
3. Every plain step: the runner fills the request's row of the token bitmask, the sampler masks
   the logits, the matcher takes the sampled token (worker/runner.py). Overlapped decode never
   runs such a request: its next mask needs this step's token on the host.
4. Finish, however it happens (stop, length, abort, a failed room, a failed step):
   `Grammars.release` closes the matcher; `num_live` is 0 on a drained worker.

PD: both legs get the same `structured`. Prefill samples the first token under its mask; the
decode worker's matcher accepts that token before it fills its first mask, and goes on from
there (decode never re-runs the prompt, and nothing is ever fed to a matcher twice).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.request import Request
from worker.sampling import GrammarError, StructuredOutput

if TYPE_CHECKING:
    from worker.grammar_xgr import GrammarBackend

__all__ = ["GrammarError", "Grammars"]


class Grammars:
    """Builds the worker's grammar backend on first use; attaches and releases matchers."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers all of it
        self.eos_token_ids = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def backend(self) -> GrammarBackend:
        """Any thread. Raises GrammarError when the model directory has no tokenizer.json."""
        with self._lock:
            if self._backend is None:
                from worker.grammar_xgr import GrammarBackend

                self._backend = GrammarBackend.for_model(self.model_dir, self.vocab_size,
                                                         self.eos_token_ids)
            return self._backend

    def compile(self, structured: StructuredOutput) -> None:
        """Any thread (the server's pool, at submit): compile into the cache, or raise
        GrammarError."""
        self.backend().compile(structured)

    def attach(self, request: Request) -> None:
        """Loop thread: the request's own matcher; stop tokens are eos and its stop ids."""
        structured = request.sampling.structured
        if structured is None or request.grammar is not None:
            return
        stops = (*self.eos_token_ids, *request.sampling.stop_token_ids)
        request.grammar = self.backend().matcher(request.request_id, structured, stops)

    @staticmethod
    def release(request: Request) -> None:
        """Loop thread, at finish: close the matcher (idempotent)."""
        if request.grammar is not None:
            request.grammar.close()
            request.grammar = None

    @property
    def num_live(self) -> int:
        """Matchers not closed yet (0 before the first grammar)."""
        return self._backend.num_live if self._backend is not None else 0
