"""A prefill worker's bootstrap address: the string its GetInfo reports and a Generate carries.

Format: one `host:port` per rank; a tensor-parallel worker lists its ranks comma-separated in
rank order; a worker with attention DP lists its groups separated by ';'. A room lives in group
`room % groups`: the prefill worker computes it there, decode registers with that group's
ranks, and the gateway draws room ids so that a prompt lands in the group whose prefix cache
holds it. Written and read by the worker (its ranks, its DP groups), the transfer layer
(decode's registrations and holds) and the gateway, so it lives here and imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Sequence

_ROOM_SPACE = 1 << 64  # room ids are uint64 on the wire; 0 means "no room"


def join(groups: Sequence[Sequence[str]]) -> str:
    """The address string of DP groups of rank addresses (each in rank order)."""
    return ";".join(",".join(ranks) for ranks in groups)


def num_groups(bootstrap_addr: str) -> int:
    return bootstrap_addr.count(";") + 1


def group_of(room: int, groups: int) -> int:
    """The DP group that computes `room` on a prefill worker of `groups` groups."""
    return room % groups


def room_ranks(bootstrap_addr: str, room: int) -> list[str]:
    """The bootstrap addresses of `room`'s prefill ranks, in rank order."""
    groups = bootstrap_addr.split(";")
    ranks = groups[group_of(room, len(groups))].split(",")
    return [a.strip() for a in ranks if a.strip()]


def room_in_group(draw: int, group: int, groups: int) -> int:
    """A nonzero room id from a random `draw` that `group_of` maps to `group`."""
    room = draw % (_ROOM_SPACE // groups) * groups + group  # below 2**64: no wrap to undo
    return room or groups
