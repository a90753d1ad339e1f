"""Routing policies as pure functions of candidates and prompt (no gRPC)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.routing import CacheAware, LeastLoad, RoundRobin, least_loaded, page_hashes


@dataclass(eq=False)
class W:
    url: str
    load: float = 0.0

    def load_score(self) -> float:
        return self.load


def test_round_robin_cycles():
    ws = [W("a"), W("b"), W("c")]
    rr = RoundRobin()
    assert [rr.pick(ws, []).url for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert rr.pick(ws[:1], []).url == "a"


def test_least_load_picks_lowest_and_spreads_ties():
    ws = [W("a", 3), W("b", 1), W("c", 2)]
    ll = LeastLoad()
    assert {ll.pick(ws, []).url for _ in range(5)} == {"b"}
    ties = [W("a", 1), W("b", 1)]
    assert {ll.pick(ties, []).url for _ in range(4)} == {"a", "b"}


def test_page_hashes_are_prefix_chained():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = page_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same second page, different prefix: different hash


def test_cache_aware_follows_longest_prefix():
    ws = [W("a"), W("b"), W("c")]
    ca = CacheAware(page_size=4, load_threshold=5)
    sys_a, sys_b = list(range(100, 116)), list(range(200, 216))
    first_a = ca.pick(ws, sys_a + [1, 2]).url
    ws_by = {w.url: w for w in ws}
    ws_by[first_a].load = 1  # it now has a request; least-load would go elsewhere
    first_b = ca.pick(ws, sys_b + [3]).url
    assert first_b != first_a
    for i in range(5):  # same prefixes return to the same workers
        assert ca.pick(ws, sys_a + [i, i, i, i]).url == first_a
        assert ca.pick(ws, sys_b + [i]).url == first_b
    # a longer shared prefix wins over a shorter one
    ca.pick([ws_by["c"]], sys_a + [7, 7, 7, 7, 8, 8, 8, 8])
    assert ca.pick(ws, sys_a + [7, 7, 7, 7, 8, 8, 8, 8, 9]).url == "c"


def test_cache_aware_balances_against_load():
    a, b = W("a"), W("b")
    ca = CacheAware(page_size=4, load_threshold=5)
    prompt = list(range(32))
    assert ca.pick([a], prompt).url == "a"
    a.load = 5
    assert ca.pick([a, b], prompt).url == "a"  # within threshold: keep the cache hit
    a.load = 6
    assert ca.pick([a, b], prompt).url == "b"  # too busy: least-loaded wins
    assert ca.pick([a, b], prompt).url == "b"  # and now b owns the prefix


def test_cache_aware_memory_is_bounded():
    ca = CacheAware(page_size=2, max_pages=50)
    ws = [W("a"), W("b")]
    for i in range(100):
        ca.pick(ws, [i] * 20)
    assert len(ca) == 50


def test_cache_aware_ignores_unhealthy_owner():
    a, b = W("a"), W("b")
    ca = CacheAware(page_size=4)
    prompt = list(range(16))
    ca.pick([a], prompt)
    assert ca.pick([b], prompt).url == "b"  # a is not a candidate (unhealthy or excluded)


def test_cache_aware_keeps_a_prefix_in_its_dp_group():
    """A prefill worker with attention DP: a session's next turn runs in the group that ran its
    prefix there (each group has its own cache); a new prefix takes the group given; a prefix
    last run on another worker, or in a group past this worker's count, does not carry."""
    ca = CacheAware(page_size=2)
    idle = [0.0, 0.0]
    turn1, turn2 = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    assert ca.group("p0", turn1, idle, fresh=1) == 1
    assert ca.group("p0", turn2, idle, fresh=0) == 1  # its first two pages ran in group 1
    assert ca.group("p0", [9, 9, 9, 9], idle, fresh=0) == 0  # a new prefix
    ws = [W("p0"), W("p1")]
    assert ca.pick(ws, turn2).url == "p0"  # pick keeps the pages' group at the same worker
    assert ca.group("p0", turn2 + [7, 8], idle, fresh=0) == 1
    assert ca.group("p1", turn2, idle, fresh=0) == 0  # p1 never ran it: fresh, and now p1's
    assert ca.group("p0", turn2, idle, fresh=0) == 0  # p0's claim was replaced by p1's
    assert ca.group("p0", [5, 5], [0.0] * 4, fresh=3) == 3
    assert ca.group("p0", [5, 5], idle, fresh=1) == 1


def test_a_shared_prefix_spills_to_the_least_loaded_dp_group():
    """Every request of an agent shares its system prompt: without a load bound they all ran
    in the one group that first ran it, the other groups idle. The prefix's group keeps them
    while it is at most `load_threshold` busier than the least-loaded group; past that the
    least-loaded group takes the request (and the prefix's pages there are remembered too). A
    new prefix goes to the least-loaded group; equal loads take `fresh` (the groups in turn)."""
    ca = CacheAware(page_size=2, load_threshold=4.0)
    system = [1, 2, 3, 4]
    assert ca.group("p0", system + [5, 6], [0.0, 0.0, 0.0], fresh=2) == 2
    assert ca.group("p0", system + [7, 8], [4.0, 0.0, 4.0], fresh=0) == 2  # within the bound
    assert ca.group("p0", system + [9, 9], [0.0, 0.5, 4.6], fresh=0) == 0  # past it: spill
    assert ca.group("p0", system + [8, 8], [9.0, 0.5, 4.0], fresh=2) == 1  # 0 owns it now
    assert ca.group("p0", [6, 6, 6, 6], [3.0, 1.0, 1.0], fresh=2) == 2  # new: least, then fresh
    assert least_loaded([2.0, 1.0, 1.0, 3.0], start=3) == 1 and least_loaded([1.0], 5) == 0
