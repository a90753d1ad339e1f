"""Prompt lookup (speculative.method ngram) at long contexts: the same drafts, at a step cost that
does not hold the engine loop.

The n-gram drafter runs on the engine's host thread between schedule and run, for every decode
request of every step, so its cost adds to every step's latency. A scan in Python over each
request's whole history grows with the context (about 2.4 ms a request at 32k tokens on the dev
box: 150 ms a step at batch 64, against a GPU decode step of a few ms). The drafter keeps each
request's tokens in an array that grows with it and searches it with vectorized comparisons.

- Its drafts equal the plain definition's (the most recent earlier occurrence of the longest
  recurring tail n-gram, min_n <= n <= max_n, and what followed it), on random histories with
  many repeats and few, step after step as requests grow, when a request is dropped and comes
  back, and for a new request object under an old one's id.
- After a request's first step, a step reads only the tokens it emitted (its cost on the host
  is the search, not a copy of the history). The speed itself is a benchmark's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from tests.worker.factories import make_request
from worker.config import SpeculativeConfig
from worker.request import Request, RequestStatus
from worker.spec import NgramDrafter
from worker.spec.ngram import lookup
from worker.step import ScheduledChunk, SchedulePlan


def _reference(history: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: longest n first, most recent earlier match first."""
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = list(history[size - n:])
        for start in range(size - n - 1, -1, -1):
            if list(history[start:start + n]) == tail:
                return list(history[start + n:start + n + k])
    return []


def _propose(history: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    return lookup(np.asarray(history, dtype=np.int64), k, min_n, max_n)


def _plan(requests: list[Request], k: int) -> SchedulePlan:
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, True, max_drafts=k) for r in requests]
    return SchedulePlan(chunks, len(chunks))


def test_ngram_proposes_what_followed_the_last_match() -> None:
    assert _propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]  # 3-gram [1, 2, 3] recurs
    assert _propose([5, 6, 7], 2, 1, 3) == []  # nothing recurs
    assert _propose([4, 8, 4, 8, 4], 2, 1, 3) == [8, 4]  # the most recent occurrence wins
    assert _propose([7, 1, 7, 2, 7], 4, 2, 2) == []  # [2, 7] never seen before


def test_proposals_equal_the_definition_on_random_histories() -> None:
    rng = random.Random(3)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 20, 1000])
        history = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 8)
        want = _reference(history, k, min_n, max_n)
        assert _propose(history, k, min_n, max_n) == want, (trial, history)


def test_the_drafter_follows_growing_requests_step_by_step() -> None:
    rng = random.Random(8)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1,
                               ngram_max=3)
    drafter = NgramDrafter(config)
    requests = [make_request(prompt=[rng.randrange(4) for _ in range(rng.randrange(1, 30))])
                for _ in range(6)]
    for step in range(60):
        # Some requests skip a step (their cached tokens must still be right when they return).
        live = [r for i, r in enumerate(requests) if (step + i) % 5]
        plan = _plan(live, 4)
        drafter.draft(plan)
        for chunk in plan.chunks:
            assert chunk.drafts == _reference(chunk.request.all_token_ids(), 4, 1, 3)
            assert chunk.num_tokens == 1 + len(chunk.drafts)
        assert plan.num_tokens == sum(c.num_tokens for c in plan.chunks)
        for r in live:  # the step emitted one to three tokens
            r.output_token_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
    # A new request under an old one's id gets its own tokens' drafts.
    old = requests[0]
    new = Request(old.request_id, [9, 8, 9], old.sampling)
    plan = _plan([new], 4)
    drafter.draft(plan)
    assert plan.chunks[0].drafts == [8, 9]


class _CountingList(list):  # type: ignore[type-arg]
    """A token list that counts the elements its slices hand out."""

    read = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        out = super().__getitem__(index)
        if isinstance(index, slice):
            _CountingList.read += len(out)
        return out


def test_a_step_over_a_long_history_reads_only_its_new_tokens(monkeypatch) -> None:
    """The step cost that does not grow with the context: after a request's first step, a step
    copies in only the tokens it emitted (the prompt and the earlier output are not read again,
    nor the request's all_token_ids()), and the drafts stay the definition's."""
    rng = random.Random(1)
    req = make_request(prompt=[rng.randrange(150_000) for _ in range(20_000)])
    req.prompt_token_ids = _CountingList(req.prompt_token_ids)
    req.output_token_ids = _CountingList(req.output_token_ids)
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    drafter.draft(_plan([req], 3))  # the first step reads the prompt in
    monkeypatch.setattr(Request, "all_token_ids", lambda self: pytest.fail("read it all"))
    for step in range(8):
        new = [rng.randrange(150_000) for _ in range(step % 3 + 1)]
        list.extend(req.output_token_ids, new)
        _CountingList.read = 0
        plan = _plan([req], 3)
        drafter.draft(plan)
        assert _CountingList.read <= len(new), (step, _CountingList.read)
        history = list(req.prompt_token_ids) + list(req.output_token_ids)
        assert plan.chunks[0].drafts == _reference(history, 3, 1, 4)  # the config's n-grams


def test_two_plans_a_step_keep_their_histories_and_finished_requests_leave() -> None:
    """With attention DP every group's plan drafts through the one drafter, each step: neither
    plan's requests are read in again, and a finished request's array is dropped."""
    rng = random.Random(4)
    groups = [[make_request(prompt=[rng.randrange(50) for _ in range(300)]) for _ in range(2)]
              for _ in range(2)]
    for req in (r for g in groups for r in g):
        req.prompt_token_ids = _CountingList(req.prompt_token_ids)
        req.output_token_ids = _CountingList(req.output_token_ids)
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    for g in groups:
        drafter.draft(_plan(g, 3))  # the first step reads the prompts in
    for step in range(4):
        _CountingList.read = 0
        for g in groups:
            for req in g:
                list.append(req.output_token_ids, rng.randrange(50))
            drafter.draft(_plan(g, 3))
        assert _CountingList.read <= 4, (step, _CountingList.read)  # one new token each
    done = groups[1][0]
    done.status = RequestStatus.FINISHED_LENGTH
    drafter.draft(_plan(groups[0], 3))
    assert done.request_id not in drafter.histories
    assert {r.request_id for r in (*groups[0], groups[1][1])} <= set(drafter.histories)
