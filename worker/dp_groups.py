"""Which attention-DP group a new request joins on a mono or decode worker.

Each DP group has its own pages and its own prefix cache, so an agent's next turn hits the cache
only in the group that ran the turn before. Shortest queue alone (SGLang's default dispatch)
sends it elsewhere: after a turn, the group that ran it holds the conversation's pages as cache,
so the other group has the more free pages. Prefill workers do not come here: they put room r in
group r % dp_size, the rule decode uses to pick which group to register with.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.scheduler import Scheduler


def pick_group(schedulers: Sequence[Scheduler], token_ids: list[int]) -> int:
    """The group holding the longest cached prefix of `token_ids`, unless its queue (running +
    waiting) is longer than the shortest by more than a quarter of max_num_seqs (the gateway's
    cache_aware policy makes the same trade between workers); else the shortest queue, then
    the most free pages."""
    stats = [s.stats() for s in schedulers]
    loads = [(st.running + st.waiting, -st.free_pages) for st in stats]
    least = loads.index(min(loads))
    hits = [s.cache.cached_prefix(token_ids) for s in schedulers]
    best = max(range(len(schedulers)), key=lambda g: (hits[g], [-x for x in loads[g]]))
    slack = max(1, schedulers[best].config.max_num_seqs // 4)
    if hits[best] > hits[least] and loads[best][0] - loads[least][0] <= slack:
        return best
    return least
