"""Which requests speculative decoding serves (a leaf module: the scheduler imports it)."""

from __future__ import annotations

from worker.request import Request


def speculable(req: Request) -> bool:
    """Drafts are verified for requests whose sampling reads nothing per step but the logits:
    penalties count the tokens so far, logprobs are reported per token, a grammar's mask and a
    logit bias shape each row (not applied to verify rows yet)."""
    params = req.sampling
    return not (params.has_penalties or params.logprobs or params.top_logprobs
                or params.logit_bias or req.grammar is not None or params.structured is not None)
