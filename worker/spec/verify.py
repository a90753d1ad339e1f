"""Verifying draft tokens against the target model: greedy acceptance and rejection sampling.

A verify step scores a request's last token and its k drafts in one forward, giving k + 1
rows of target logits: row i is the target's distribution for the token after draft i (row 0:
after the last accepted token). Acceptance walks the drafts in order:

- greedy (temperature 0): draft i + 1 is accepted while it equals argmax(row i); the first
  mismatch emits argmax(row i) instead, and if all k are accepted row k gives a bonus token.
  The emitted tokens are exactly what plain greedy decoding emits (lossless).
- sampling: draft x is accepted with probability min(1, p(x) / q(x)), p the target's
  distribution after the request's sampling knobs and q the drafter's; on rejection the token is
  drawn from the residual max(0, p - q), renormalised; all accepted: a bonus draw from row k.
  This preserves the target distribution exactly (Leviathan et al., Chen et al. 2023). A
  proposer that drafts deterministically (n-gram lookup) has q = one-hot on x.

Each request's draws use its own generator, row by row, so a seeded request is reproducible
whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.sampler import processed_logits, truncate
from worker.sampling import SamplingParams


def verify_rows(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                drafts: Sequence[int], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """One request's verify rows [k + 1, V] as the plain sampler would see them: row i is output
    token len(generated) + i, after drafts[:i], so its logit_bias, its penalties (over
    `generated` + drafts[:i]) and its min_tokens bans are those of plain decoding at that token
    (worker/sampler.py `processed_logits`; a copy when any applies)."""
    rows = logits.shape[0]
    if params.has_penalties:  # only penalties read the tokens before each row
        history = [[*generated, *drafts[:i]] for i in range(rows)]
    else:
        history = [[] for _ in range(rows)]
    return processed_logits(logits, [params] * rows, history,
                            [len(generated) + i for i in range(rows)], eos_token_ids)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] of one request → its sampling distribution per row [R, V] (temperature,
    top_k / top_p / min_p applied as the sampler applies them)."""
    x = logits / params.temperature
    if params.top_k > 0 or params.top_p < 1 or params.min_p > 0:
        x = truncate(x, [params] * x.shape[0])
    return x.softmax(dim=-1)


def accept(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens a verify step emits for one request: accepted drafts, then one more.

    logits [k + 1, V] float32 (rows as in the module doc, `verify_rows` applied); drafts: the k
    proposed tokens; draft_probs [k, V]: the drafter's distributions (None: deterministic
    drafts). Returns between 1 and k + 1 tokens.
    """
    k = len(drafts)
    assert logits.shape[0] == k + 1, f"{logits.shape[0]} rows for {k} drafts"
    out: list[int] = []
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()  # [k + 1]
        for i, draft in enumerate(drafts):
            if best[i] != draft:
                return [*out, best[i]]
            out.append(draft)
        return [*out, best[k]]
    p = target_probs(logits, params)  # [k + 1, V]
    for i, draft in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        p_x = float(p[i, draft])
        u = float(torch.rand(1, generator=generator, device=logits.device)[0])
        if q_x > 0 and u * q_x < p_x:  # accept with probability min(1, p(x) / q(x))
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[draft] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp(min=0.0)
        total = float(residual.sum())
        row = residual / total if total > 0 else p[i]  # p == q exactly: any draw from p is right
        return [*out, int(torch.multinomial(row, 1, generator=generator)[0])]
    return [*out, int(torch.multinomial(p[k], 1, generator=generator)[0])]
