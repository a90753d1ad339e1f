"""Prompt-lookup drafting: propose the tokens that followed the last n-gram's previous match.

No model: the decode worker's own token history (prompt + output) is the drafter. For n from
`max_n` down to `min_n`, the last n tokens are looked up earlier in the history, most recent
occurrence first; the tokens that followed it are the draft. Repetitive outputs (code, lists,
answers that quote the prompt) get long accepted runs; elsewhere nothing is proposed and the
request decodes one token a step as usual.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `history` ([] when no n-gram recurs)."""
        size = len(history)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = list(history[size - n :])
            # The most recent earlier occurrence whose continuation is in the history.
            for start in range(size - n - 1, -1, -1):
                if history[start] == tail[0] and list(history[start : start + n]) == tail:
                    follow = list(history[start + n : start + n + k])
                    if follow:
                        return follow
        return []
