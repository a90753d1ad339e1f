"""Prompt-lookup drafting: propose the tokens that followed the last n-gram's previous match.

No model: the decode worker's own token history (prompt + output) is the drafter. For n from
`max_n` down to `min_n`, the last n tokens are looked up earlier in the history, most recent
occurrence first; the tokens that followed it are the draft. Repetitive outputs (code, lists,
answers that quote the prompt) get long accepted runs; elsewhere nothing is proposed and the
request decodes one token a step as usual.

The lookup runs on the engine's host thread for every decode request of every step, so it
searches an int64 array with vectorized comparisons (tens of microseconds at 32k tokens, where
a scan in Python took milliseconds a request), and each request's array grows with it
(`TokenHistory`) instead of being rebuilt from its token lists every step.
"""

from __future__ import annotations

import numpy as np

from worker.request import Request


def lookup(history: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens continuing `history` (int64 [size]); [] when no n-gram recurs."""
    size = len(history)
    last = size - 1
    if last < 1:
        return []
    # Ends e of earlier occurrences of the last d + 1 tokens, e <= last - 1 so that a token
    # follows each. Longer tails filter the shorter ones' ends: one pass over the history.
    ends = [np.flatnonzero(history[:last] == history[last])]
    for d in range(1, min(max_n, last)):
        prev = ends[-1]
        prev = prev[prev >= d]
        ends.append(prev[history[prev - d] == history[last - d]])
    for n in range(len(ends), min_n - 1, -1):
        found = ends[n - 1]
        if found.size:
            e = int(found[-1])  # the most recent occurrence
            return [int(t) for t in history[e + 1 : e + 1 + k]]
    return []


class TokenHistory:
    """One request's tokens (prompt, then output) as an int64 array that grows with it.

    Tokens are only ever appended to a request (a preempted one keeps its output), so each step
    copies in only the new ones; a request whose tokens do not continue what is held (another
    request object under the same id) is read in again."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.buf = np.empty(max(64, 2 * request.num_tokens), dtype=np.int64)
        self.size = 0

    def tokens(self) -> np.ndarray:
        """The request's tokens now: a view of the buffer, valid until the next call."""
        req = self.request
        prompt, output = req.prompt_token_ids, req.output_token_ids
        total, num_prompt = len(prompt) + len(output), len(prompt)
        if total < self.size:  # cannot happen to an append-only request: read it in again
            self.size = 0
        if total > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), total), dtype=np.int64)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if self.size < num_prompt:
            self.buf[self.size : num_prompt] = prompt[self.size :]
        done = max(self.size, num_prompt)
        if done < total:
            self.buf[done:total] = output[done - num_prompt :]
        self.size = total
        return self.buf[:total]
