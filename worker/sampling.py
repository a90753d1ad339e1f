"""Per-request sampling parameters, mirroring protocol/tandem.proto's SamplingParams.

The dataclass holds normalized values (the proto's "0 means off/default" conventions are
resolved in `from_proto`), and `validate()` raises `SamplingParamsError` naming the field.
`StructuredOutput` is the request's grammar as the wire gives it; worker/grammar.py compiles
it (this module stays free of the grammar engine, so unconstrained workers never import it).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from protocol.sampling import GREEDY_BELOW

MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's bound on |logit_bias|


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"sampling.{field}: {message}")
        self.field = field


class StructuredKind(enum.Enum):
    """The `StructuredOutput.kind` oneof of the wire (the value is the proto field's name)."""

    JSON_SCHEMA = "json_schema"  # a JSON schema as JSON text; strict: only what it allows
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # the whole output matches the regular expression
    CHOICE = "choice"  # the output is exactly one of `choices`
    EBNF = "ebnf"  # xgrammar's EBNF (GBNF-style), start rule `root`
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's structural-tag JSON


class GrammarError(SamplingParamsError):
    """A grammar cannot be compiled here (worker/grammar_xgr.py); `field` names it (the server's
    INVALID_ARGUMENT). Defined here so the grammar engine and its handle share it without one
    importing the other's module at the top."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. Hashable: compiled grammars are cached by it."""

    kind: StructuredKind
    text: str = ""  # the schema / regex / grammar / tag; "" for JSON_OBJECT and CHOICE
    choices: tuple[str, ...] = ()  # CHOICE only

    @property
    def field(self) -> str:
        """The wire field that carries it, for error messages: structured.<kind>."""
        return f"structured.{self.kind.value}"

    def validate(self) -> None:
        if self.kind is StructuredKind.CHOICE:
            if not self.choices:
                raise SamplingParamsError(self.field, "is empty: send at least one choice")
        elif self.kind is not StructuredKind.JSON_OBJECT and not self.text.strip():
            raise SamplingParamsError(self.field, f"is empty: send the {self.kind.value} text")

    @classmethod
    def from_proto(cls, msg: Any) -> StructuredOutput:
        """From a `tandem_pb2.StructuredOutput` (the caller checked that the field is set)."""
        which = msg.WhichOneof("kind")
        if which is None:
            raise SamplingParamsError("structured", "no kind is set: set one of json_schema, "
                                      "json_object, regex, choice, ebnf, structural_tag or leave "
                                      "structured unset")
        kind = StructuredKind(which)
        if kind is StructuredKind.JSON_OBJECT:
            if not msg.json_object:
                raise SamplingParamsError("structured.json_object",
                                          "is false: set it to true or leave structured unset")
            return cls(kind)
        if kind is StructuredKind.CHOICE:
            return cls(kind, choices=tuple(msg.choice.choices))
        return cls(kind, text=str(getattr(msg, which)))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy (argmax, exactly)
    top_k: int = 0  # 0 = off; keep the k most likely tokens
    top_p: float = 1.0  # 1 = off; keep the smallest set whose probability reaches top_p
    min_p: float = 0.0  # 0 = off; drop tokens below min_p * the top token's probability
    seed: int | None = None  # per-request generator seed; None = the worker's global RNG
    max_tokens: int = 16  # new tokens at most (>= 1)
    min_tokens: int = 0  # eos and stop ids are masked until this many tokens are generated
    stop_token_ids: tuple[int, ...] = ()  # generation stops after any of these
    ignore_eos: bool = False  # eos is an ordinary token (neither stops nor is masked)
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # also return the n most likely alternatives (0 = none)
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already generated
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a generated token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits first
    structured: StructuredOutput | None = None  # the output must match it (worker/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(field, message)

        check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
              f"must be >= 0 (0 = greedy), got {self.temperature}")
        check(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1] (0 = off), got {self.min_p}")
        check(self.seed is None or 0 <= self.seed < 2**64, "seed",
              f"must fit in 64 unsigned bits, got {self.seed}")
        check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              f"token ids must be >= 0, got {list(self.stop_token_ids)}")
        check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
              f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty",
              f"must be > 0 (1 = off), got {self.repetition_penalty}")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty",
              f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"must be in [-2, 2], got {self.frequency_penalty}")
        for token, bias in self.logit_bias:
            check(token >= 0, "logit_bias", f"token ids must be >= 0, got {token}")
            check(math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS, "logit_bias",
                  f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                  f"got {bias} for token {token}")
        if self.structured is not None:
            self.structured.validate()

    @classmethod
    def from_proto(cls, msg: Any) -> SamplingParams:
        """From a `tandem_pb2.SamplingParams`, resolving the wire's zero-means-default fields."""
        return cls(
            temperature=float(msg.temperature),
            top_k=max(int(msg.top_k), 0),  # <= 0 = off on the wire
            top_p=float(msg.top_p) or 1.0,  # 0 (unset) = off
            min_p=float(msg.min_p),
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_tokens=int(msg.max_tokens),
            min_tokens=int(msg.min_tokens),
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            ignore_eos=bool(msg.ignore_eos),
            logprobs=bool(msg.logprobs),
            top_logprobs=int(msg.top_logprobs),
            repetition_penalty=float(msg.repetition_penalty) or 1.0,  # 0 (unset) = off
            presence_penalty=float(msg.presence_penalty),
            frequency_penalty=float(msg.frequency_penalty),
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
            structured=(StructuredOutput.from_proto(msg.structured)
                        if msg.HasField("structured") else None),
        )
