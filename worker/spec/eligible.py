"""Which requests speculative decoding serves, and how many drafts each gets in a step (a leaf
module: the scheduler imports it)."""

from __future__ import annotations

from worker.request import Request


def speculable(req: Request) -> bool:
    """Drafts are verified for requests whose tokens are sampled from the logits, biased and
    penalized row by row (worker/spec/verify.py `verify_rows`): not for those that report
    logprobs (one per token, from the plain sampler) or follow a grammar (its mask is computed
    per token, after the one before is accepted)."""
    params = req.sampling
    return not (params.logprobs or params.top_logprobs
                or req.grammar is not None or params.structured is not None)


def num_drafts(req: Request, k: int, n: int, budget: int, max_model_len: int,
               seeded_cap: int) -> int:
    """Room for draft tokens after a chunk of `n` tokens: at most `k`, within the request's
    max_tokens, the context and `budget` (the step's tokens left after the chunk); 0 for prompt
    chunks and for requests whose sampling speculation cannot serve.

    A seeded sampling request's tokens depend on how many drafts it gets (each is a draw from
    its generator, and so is the verify's token after them), so that number must not depend on
    what else shares the step: it gets min(k, `seeded_cap`, its own bounds) or, where the
    budget left is smaller, -1 (it waits for the next step) — never fewer."""
    if not k or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
        return 0
    if not req.output_token_ids or not speculable(req):
        return 0
    left = req.sampling.max_tokens - len(req.output_token_ids) - 1
    room = max_model_len - req.num_tokens - 1
    own = max(0, min(k, left, room))
    if fixed_drafts(req):
        own = min(own, seeded_cap)
        return own if own <= budget else -1
    return min(own, budget)


def fixed_drafts(req: Request) -> bool:
    """Seeded sampling: its draws follow its drafts, so their number is the request's own."""
    return req.sampling.seed is not None and not req.sampling.greedy and speculable(req)


def recompute_len(req: Request, k: int) -> int:
    """Tokens a chunk may compute towards the request's end: a seeded request recomputing its
    output after a preemption stops before its last token, which then decodes with its drafts
    as it would have without the preemption (a recompute that sampled it would draw once where
    the verify draws per draft)."""
    left = req.num_tokens - req.num_computed_tokens
    if k and left > 1 and req.output_token_ids and fixed_drafts(req):
        return left - 1
    return left
