"""The batched sampler: logits of the step's last tokens → one new token per request.

Order of processing, per request:
1. logit_bias is added (OpenAI's semantics: to the raw logits, before anything else);
2. penalties over the tokens it has generated so far (repetition, presence, frequency);
3. min_tokens: eos (unless ignore_eos) and stop ids are banned until min_tokens are out
   (for a constrained row the ban is in its grammar mask, worker/grammar.py);
4. the grammar mask of constrained rows: tokens the grammar does not allow become -inf;
5. logprobs are read here — from the biased, penalized, masked distribution, before
   temperature and truncation (so they describe what can be sampled, not the sampler's
   knobs); a token that cannot be sampled is never listed among the top alternatives;
6. greedy (temperature 0): argmax, exactly. Otherwise temperature, top_k, top_p, min_p,
   then one draw from the request's own generator.

Each seeded request draws from its own `torch.Generator` with row-wise operations only, so
its samples do not depend on which requests share the batch or in what order. The all-greedy
batch with no penalties and no logprobs is one argmax over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.sampling import SamplingParams


@dataclass
class SampleOutput:
    token_ids: list[int]  # one sampled token per request, in batch order
    logprobs: list[float] | None  # the sampled token's logprob per request; None if nobody asked
    # Per request, most likely first; [] if not asked.
    top_logprobs: list[list[tuple[int, float]]] | None


class GrammarViolation(RuntimeError):
    """A token the request's matcher refused: a bug, or a PD peer that sampled it unmasked.
    `error_code` says whose fault it is (worker/server.py maps it to a status)."""

    def __init__(self, request_id: str, token: int, where: str) -> None:
        super().__init__(f"grammar: token {token} ({where}) does not match the request's grammar")
        self.request_id = request_id
        self.error_code = "internal"


class GrammarDeadEnd(GrammarViolation):
    """The request's grammar allows no token of the vocabulary at this point (it asks for text
    this model's tokenizer cannot write, e.g. a character it has no token for): the client's."""

    def __init__(self, request_id: str) -> None:
        RuntimeError.__init__(
            self, "structured output cannot continue: the grammar allows no token of this "
                  "model's vocabulary here (it asks for text the tokenizer cannot write)")
        self.request_id = request_id
        self.error_code = "invalid"


class NoAllowedToken(Exception):
    """A masked row with no token left (the runner turns it into GrammarDeadEnd)."""

    def __init__(self, row: int) -> None:
        super().__init__(row)
        self.row = row


class TokenMask(Protocol):
    """A step's grammar mask (worker/grammar.py's GrammarMask): which rows it constrains, and
    how to push their disallowed tokens to -inf in place."""

    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None: ...


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator the engine keeps for a request's whole life (None = global RNG).

    Every bit of the 64-bit seed counts, on every device (prefill and decode derive the same
    state from the seed, so PD draws what mono draws):
    - CUDA: Philox keys on the whole 64-bit seed (`manual_seed`).
    - CPU: torch's mt19937 keeps only the seed's low 32 bits (`manual_seed(2**62)` and
      `manual_seed(2**63)` draw the same stream). A seed below 2**32 keeps torch's own stream;
      a larger one gets the mt19937 state of `init_by_array([seed & 0xffffffff, seed >> 32])`
      (MT19937's reference seeding for a longer key; numpy's `RandomState([lo, hi])`).
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    if gen.device.type != "cpu" or seed < 2**32:
        return gen.manual_seed(seed)
    gen.set_state(_mt19937_state(seed))
    return gen


# torch's CPU generator state (CPUGeneratorImplStateLegacy): the_initial_seed u64, left i32,
# seeded i32, next u64, then the 624 mt19937 words as u64 each, then the normal caches.
_MT_WORDS_AT = 24


def _mt19937_state(seed: int) -> torch.Tensor:
    """A CPU generator's state seeded by init_by_array with the seed's two 32-bit halves."""
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    mt = np.random.RandomState(key).get_state(legacy=False)["state"]
    words = np.asarray(mt["key"]).astype("<u8")  # 624 words; pos 624: regenerate first
    state = torch.Generator().manual_seed(0).get_state().numpy().copy()  # uint8 [5056]
    head = np.array([seed], dtype="<u8").tobytes() + np.array([1, 1], dtype="<i4").tobytes()
    state[:16] = np.frombuffer(head, dtype=np.uint8)  # initial seed, left=1 (regenerate), seeded
    state[16:24] = 0  # next
    state[_MT_WORDS_AT:_MT_WORDS_AT + 624 * 8] = np.frombuffer(words.tobytes(), dtype=np.uint8)
    return torch.from_numpy(state)


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance `generator` past the draw of one token as `Sampler._draw` takes it: a multinomial
    over one float32 row of the vocabulary, whose randomness depends on the row's shape, not its
    values. A decode worker skips the first token's draw, which prefill made from the same seed,
    so that its tokens continue the stream a mono worker draws from."""
    torch.multinomial(torch.ones(vocab_size, device=generator.device), 1, generator=generator)


def _apply_penalties(row: torch.Tensor, generated: Sequence[int], p: SamplingParams) -> None:
    """In place on one row of logits [V]; penalties count the tokens generated so far."""
    if not generated:
        return
    vocab = row.shape[0]
    tokens = torch.tensor([t for t in generated if 0 <= t < vocab], dtype=torch.long,
                          device=row.device)
    counts = torch.bincount(tokens, minlength=vocab).to(row.dtype)  # [V]
    present = counts > 0
    if p.repetition_penalty != 1.0:
        # CTRL-style: shrink positive logits, push negative ones further down.
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(present, penalized, row))
    row -= p.frequency_penalty * counts + p.presence_penalty * present.to(row.dtype)


def _add_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place on logits [B, V]: each request's (token, bias) pairs, in one scatter-add."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            if token < vocab:  # the server refused ids outside the vocabulary
                rows.append(i)
                cols.append(token)
                values.append(bias)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    biases = torch.tensor(values, device=device, dtype=logits.dtype)
    logits.index_put_(index, biases, accumulate=True)


def min_tokens_bans(p: SamplingParams, generated: int, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids min_tokens still bans after `generated` tokens (the runner masks them in the
    bitmask of a constrained row)."""
    if generated >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))


def processed_logits(logits: torch.Tensor, params: list[SamplingParams],
                     output_token_ids: list[list[int]], num_generated: list[int],
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Steps 1-3 of the module doc (logit_bias, penalties, min_tokens bans), row by row, on a
    copy when any applies: what the sampler tempers and draws from. Speculative verify rows
    (worker/spec/verify.py) go through it so that a draft is judged as plain decoding would."""
    return Sampler._masked(logits, params, output_token_ids, num_generated, eos_token_ids)


def truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside top_k / top_p / min_p to -inf, row by row. x: [R, V] (tempered)."""
    r, vocab = x.shape
    device = x.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)  # [R]
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=x.dtype)  # [R]
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=x.dtype)  # [R]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=device)[None, :]  # [1, V]
    remove = rank >= top_k[:, None]
    probs = sorted_x.masked_fill(remove, float("-inf")).softmax(dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 is off: rounding in the cumsum must not cut the tail.
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    remove |= probs < min_p[:, None] * probs[:, :1]  # the top token always survives
    remove[:, 0] = False
    return x.scatter(1, order, sorted_x.masked_fill(remove, float("-inf")))


class Sampler:
    """Stateless; the engine owns generators and the generated-token history."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_token_ids: list[list[int]],
        num_generated: list[int],
        eos_token_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> SampleOutput:
        """logits [B, V] float32 → one token per row (see the module doc for the order)."""
        b = logits.shape[0]
        assert len(params) == len(generators) == len(output_token_ids) == len(num_generated) == b
        want_logprobs = any(p.logprobs or p.top_logprobs for p in params)
        logits = self._masked(logits, params, output_token_ids, num_generated, eos_token_ids, mask)
        tokens = self._pick(logits, params, generators)
        token_ids: list[int] = tokens.tolist()
        if not want_logprobs:
            return SampleOutput(token_ids, None, None)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top: list[list[tuple[int, float]]] = []
        for i, p in enumerate(params):
            if p.top_logprobs:
                values, top_ids = logprobs[i].topk(p.top_logprobs)  # sorted, most likely first
                # A masked token (a grammar, min_tokens) cannot be sampled: not an alternative.
                top.append([(t, v) for t, v in zip(top_ids.tolist(), values.tolist(), strict=True)
                            if v != -math.inf])
            else:
                top.append([])
        return SampleOutput(token_ids, chosen, top)

    def sample_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None], num_generated: list[int],
                      eos_token_ids: Sequence[int]) -> torch.Tensor:
        """The tokens [B] left on the logits' device (no host sync), for the overlapped decode:
        rows without penalties (they read the tokens generated so far), without logprobs and
        without a grammar (its next mask needs this token on the host)."""
        assert not any(p.has_penalties or p.logprobs or p.top_logprobs or p.structured
                       for p in params)
        empty: list[list[int]] = [[] for _ in params]
        masked = self._masked(logits, params, empty, num_generated, eos_token_ids)
        return self._pick(masked, params, generators)

    @staticmethod
    def _masked(logits: torch.Tensor, params: list[SamplingParams],
                output_token_ids: list[list[int]], num_generated: list[int],
                eos_token_ids: Sequence[int],
                mask: TokenMask | None = None) -> torch.Tensor:
        """Bias, penalties, min_tokens bans and the grammar mask applied (on a copy: the input
        may be a CUDA graph's output buffer; the input itself when nothing applies)."""
        constrained = set(mask.rows) if mask is not None else set()
        banned = [[] if i in constrained else min_tokens_bans(p, n, eos_token_ids)
                  for i, (p, n) in enumerate(zip(params, num_generated, strict=True))]
        biased = any(p.logit_bias for p in params)
        if not (biased or any(p.has_penalties for p in params) or any(banned) or constrained):
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        if biased:
            _add_logit_bias(logits, params)
        for i, p in enumerate(params):
            if p.has_penalties:
                _apply_penalties(logits[i], output_token_ids[i], p)
            ids = [t for t in banned[i] if 0 <= t < vocab]
            if ids:
                logits[i, ids] = float("-inf")
        if mask is not None:
            mask.apply(logits)
            dead = [i for i in mask.rows if not bool(torch.isfinite(logits[i]).any())]
            if dead:  # nothing to sample from: that request's grammar cannot go on
                raise NoAllowedToken(dead[0])
        return logits

    def _pick(self, logits: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> torch.Tensor:
        """argmax for greedy rows, a draw for the others → tokens [B] on the logits' device."""
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)  # the common fast path: one kernel for the batch
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        tokens[sampled] = self._draw(logits[sampled], [params[i] for i in sampled],
                                     [generators[i] for i in sampled])
        return tokens

    @staticmethod
    def _draw(
        logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits [R, V] of the sampled rows → tokens [R]; each row uses its own generator."""
        temps = torch.tensor([p.temperature for p in params], device=logits.device,
                             dtype=logits.dtype)
        x = logits / temps[:, None]  # [R, V]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            x = truncate(x, params)
        probs = x.softmax(dim=-1)  # [R, V]
        out = torch.empty(len(params), dtype=torch.long, device=logits.device)
        for j, gen in enumerate(generators):
            out[j] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out
