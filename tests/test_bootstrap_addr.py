"""The bootstrap address format and the room -> DP group rule (protocol/bootstrap_addr.py)."""

from __future__ import annotations

import random

import pytest

from protocol import bootstrap_addr as ba


def test_join_and_read_back_tp_ranks_of_dp_groups() -> None:
    addr = ba.join([["a:1", "a:2"], ["b:1", "b:2"], ["c:1", "c:2"]])
    assert addr == "a:1,a:2;b:1,b:2;c:1,c:2" and ba.num_groups(addr) == 3
    assert ba.room_ranks(addr, 4) == ["b:1", "b:2"]  # 4 % 3
    assert ba.room_ranks(" x:9 ", 123) == ["x:9"] and ba.num_groups("x:9") == 1


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 8])
def test_a_drawn_room_lands_in_its_group_and_is_never_zero(groups: int) -> None:
    rng = random.Random(groups)
    draws = [0, 1, (1 << 64) - 1, *(rng.getrandbits(64) for _ in range(200))]
    for draw in draws:
        for group in range(groups):
            room = ba.room_in_group(draw, group, groups)
            assert 0 < room < 1 << 64
            assert ba.group_of(room, groups) == group, (draw, group, groups)
