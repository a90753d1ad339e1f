"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

One engine step with speculation (worker/engine.py):

    plan = scheduler.schedule()   # decode chunks keep room for up to k drafts (max_drafts)
    drafter.draft(plan)           # fills chunk.drafts (n-gram lookup, or a draft head's steps)
    out = runner.run(plan)        # one forward over each request's last token + its drafts;
                                  # worker/spec/verify.py accepts drafts and adds one token; a
                                  # model drafter then catches up (worker/spec/drafter.py)
    scheduler.update(plan, out)   # appends what was accepted, frees rejected drafts' pages

Greedy acceptance emits exactly what plain greedy decoding emits; rejection sampling keeps the
target's distribution; penalties, logit_bias and min_tokens apply to each verify row as to
that output token (worker/spec/verify.py `verify_rows`). Requests that report logprobs or
follow a grammar decode one token a step (worker/spec/eligible.py).
"""

from __future__ import annotations

import logging
from typing import Protocol

from worker.config import ConfigError, SpeculativeConfig
from worker.spec.ngram import TokenHistory, lookup
from worker.step import SchedulePlan

log = logging.getLogger(__name__)


class Drafter(Protocol):
    def draft(self, plan: SchedulePlan) -> None:
        """Fill `drafts` of the plan's chunks that keep room for them (at most max_drafts each;
        fewer or none is fine) and grow their num_tokens and the plan's accordingly."""
        ...


class NgramDrafter:
    """Prompt lookup over each request's own tokens (worker/spec/ngram.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.ngram_min, config.ngram_max
        # The token arrays of the requests drafted for, by request id, until the request
        # finishes (a waiting one keeps its own; every plan of a step, one per attention DP
        # group, drafts through this one drafter).
        self.histories: dict[str, TokenHistory] = {}

    def draft(self, plan: SchedulePlan) -> None:
        for chunk in plan.chunks:
            if not chunk.max_drafts:
                continue
            req = chunk.request
            history = self.histories.get(req.request_id)
            if history is None or history.request is not req:
                history = self.histories[req.request_id] = TokenHistory(req)
            drafts = lookup(history.tokens(), chunk.max_drafts, self.min_n, self.max_n)
            chunk.drafts = drafts
            chunk.num_tokens += len(drafts)
            plan.num_tokens += len(drafts)
        ended = [rid for rid, h in self.histories.items() if h.request.status.is_finished]
        for rid in ended:
            del self.histories[rid]


def make_drafter(config: SpeculativeConfig, model: Drafter | None = None) -> Drafter | None:
    """The drafter `speculative.method` names; None when speculation is off. `model`: the
    engine's model drafter (worker/spec/drafter.py) for draft | eagle | mtp."""
    if not config.enabled:
        return None
    if config.method != "ngram" and model is None:
        raise ConfigError(f"speculative.method={config.method} needs its drafter model loaded "
                          "(worker/spec/load.py); use ngram (or none)")
    lookup = (f" (n-grams of {config.ngram_min}-{config.ngram_max} tokens)"
              if config.method == "ngram" else "")
    # Besides /metrics' tandem_spec_* (zero until a draft is verified), only this says that
    # speculation is on; requests with logprobs or a grammar never draft.
    log.info("speculative decoding: %s%s, up to %d drafts a step (requests with logprobs or "
             "a grammar decode without)", config.method, lookup, config.num_speculative_tokens)
    if config.method == "ngram":
        return NgramDrafter(config)
    assert model is not None
    return model
