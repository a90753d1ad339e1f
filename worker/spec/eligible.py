"""Which requests speculative decoding serves (a leaf module: the scheduler imports it)."""

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
