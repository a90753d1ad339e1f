"""PD rooms on every rank of a multi-rank worker: rank 0's facade and the followers' managers.

Each rank owns a `KVTransferManager` over its own KV pool. On rank 0 the PD roles see a
`TPTransferManager` with the calls a one-rank manager offers (create_sender / create_receiver /
take_finished); it queues each room command for the followers of the room's DP group (every
rank without DP), sends them with the next ROOMS message, gathers every rank's ended rooms and
hands a room to the role when each of its ranks has ended it — SUCCESS only if it succeeded on
all of them. Followers apply the commands to their own manager (`FollowerRooms`).

Commands and reports travel as int64 lists (see worker/distributed.py for why).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from protocol.bootstrap_addr import join
from transfer.manager import KVTransferManager
from transfer.room import Room, RoomExistsError, RoomState, RoomStats, Side, TransferTotals
from worker.config import WorkerConfig
from worker.distributed import (
    MessageKind,
    StepChannel,
    from_i64,
    pack_str,
    to_i64,
    unpack_str,
)
from worker.kv_cache import KVCache, transfer_layout

_STATES = list(RoomState)


class Op(enum.IntEnum):
    CREATE_SENDER = 1
    CREATE_RECEIVER = 2
    SEND = 3
    ABORT = 4



def exchange_bootstrap_addrs(channel: StepChannel, mine: str, tp_size: int) -> str:
    """All ranks: every rank's bootstrap address, comma-separated in rank order, DP groups
    separated by ';' ("" on decode)."""
    addrs = [bytes(v[1:]).decode() for v in channel.all_gather_lists(pack_str(mine))]
    if not all(addrs):
        return ""
    return join([addrs[g : g + tp_size] for g in range(0, len(addrs), tp_size)])


@dataclass
class _End:
    state: RoomState
    error: str | None
    pages: int
    bytes: int
    first: FirstToken  # decode: what the room's prefill sent with the last pages


@dataclass
class FirstToken:
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TPRoom:
    """Rank 0's view of one room on the ranks of its DP group: rank 0's own sender/receiver (when
    the room is in rank 0's group) plus how the room ended on each of those ranks."""

    room: int
    ranks: range  # global ranks holding the room: its DP group's
    local: Room | None  # rank 0's own sender/receiver; None for a room in another DP group
    facade: TPTransferManager
    ends: dict[int, _End] = field(default_factory=dict)  # rank -> how the room ended there
    done_at: float | None = None  # when rank 0 first saw the room ended on every rank

    @property
    def done(self) -> bool:
        return len(self.ends) == len(self.ranks)

    @property
    def state(self) -> RoomState:
        if self.done:
            return self._merged()[0]
        if self.local is None:
            return RoomState.TRANSFERRING  # live on its group's ranks
        local = self.local.state
        return RoomState.TRANSFERRING if local.finished else local  # ended here, not yet everywhere

    @property
    def error(self) -> str | None:
        if self.done:
            return self._merged()[1]
        return self.local.error if self.local is not None else None

    @property
    def fault(self) -> Side | None:
        """Who failed the room, as rank 0's own room saw it (None: not known here)."""
        return self.local.fault if self.local is not None else None

    @property
    def timed_out(self) -> bool:
        return self.local.timed_out if self.local is not None else False

    @property
    def quiesced(self) -> bool:
        """No late write can land on any rank: rank 0's receiver confirmed it, and the other
        ranks (which release their rooms on their own) either succeeded or had transfer_timeout_s
        to drain since the room ended everywhere."""
        if self.local is not None and not getattr(self.local, "quiesced", True):
            return False
        if self.done and self.done_at is None:
            self.done_at = time.monotonic()
        if all(end.state is RoomState.SUCCESS for end in self.ends.values()):
            return self.done
        timeout = self.facade.local.config.transfer_timeout_s
        return self.done_at is not None and time.monotonic() - self.done_at >= timeout

    @property
    def stats(self) -> RoomStats:
        """Counters summed over ranks (each rank moves its own heads)."""
        s = dataclasses.replace(self.local.stats) if self.local is not None else RoomStats()
        s.pages = sum(e.pages for e in self.ends.values()) or s.pages
        s.bytes = sum(e.bytes for e in self.ends.values()) or s.bytes
        return s

    def _merged(self) -> tuple[RoomState, str | None]:
        for want in (RoomState.FAILED, RoomState.ABORTED):
            for rank, end in sorted(self.ends.items()):
                if end.state is want:
                    return want, f"rank {rank}: {end.error}" if rank else end.error
        return RoomState.SUCCESS, None

    # sender / receiver calls the roles make -------------------------------------------------
    def send(self, src_pages: list[int], *, start_page: int, last: bool,
             first_token: int | None = None, first_logprob: float | None = None,
             top_logprobs: list[tuple[int, float]] | None = None, **rest: object) -> None:
        """Ship pages from every rank of the room's group, each its own heads. The group's first
        rank's first token (and logprobs) is the one decode keeps."""
        if self.local is not None:
            self.local.send(src_pages, start_page=start_page, last=last, first_token=first_token,  # type: ignore[attr-defined]
                            first_logprob=first_logprob, top_logprobs=top_logprobs, **rest)
        first = FirstToken(first_token, first_logprob, list(top_logprobs or []))
        self.facade.queue(self, [Op.SEND, start_page, int(last), *pack_first(first),
                                 len(src_pages), *src_pages])

    def abort(self, reason: str) -> None:
        if self.local is not None:
            self.local.abort(reason)
        self.facade.queue(self, [Op.ABORT, *pack_str(reason)])

    @property
    def _first(self) -> FirstToken:
        end = self.ends.get(self.ranks.start)  # the group's first rank hears prefill's first rank
        return end.first if end is not None else FirstToken()

    @property
    def first_token(self) -> int | None:
        return self._first.token

    @property
    def first_logprob(self) -> float | None:
        return self._first.logprob

    @property
    def top_logprobs(self) -> list[tuple[int, float]]:
        return self._first.top

    @property
    def draft_hidden(self) -> list[float] | None:
        """Speculative eagle/mtp: the feature rank 0's receiver got (decode keeps its drafter
        state on rank 0 only; a room of another DP group has none, nor do DP workers draft)."""
        return getattr(self.local, "draft_hidden", None)


class TPTransferManager:
    """What the PD roles see on rank 0 of a multi-rank worker (the same calls as one rank's
    manager).

    A room lives on the ranks of one attention DP group (`group_of_room`, the engine's choice;
    every rank without DP): commands go to those ranks, and the room ends when each has ended it.
    """

    def __init__(self, local: KVTransferManager, channel: StepChannel, tp_size: int,
                 group_of_room: Callable[[int], int]) -> None:
        self.local = local
        self.channel = channel
        self.tp_size = tp_size
        self.group_of_room = group_of_room
        self.epoch = local.epoch
        self._cmds: list[int] = []  # queued commands for the followers, flushed at the next poll
        self._live: dict[int, TPRoom] = {}
        self._totals = TransferTotals()  # over every rank, counted as rooms end everywhere

    def queue(self, room: TPRoom, cmd: list[int]) -> None:
        """[len, op, room, group, args...]: followers outside the group skip it."""
        op, *args = cmd
        body = [op, to_i64(room.room), room.ranks.start // self.tp_size, *args]
        self._cmds.extend([len(body), *body])

    def _open(self, room: int, make_local: Callable[[], Room]) -> TPRoom:
        if room in self._live:  # ranks of other groups would not see it: check here
            raise RoomExistsError(f"room {room:#x} already exists on this worker "
                                  "(room ids must be unique per request)")
        group = self.group_of_room(room)
        ranks = range(group * self.tp_size, (group + 1) * self.tp_size)
        tp_room = self._live[room] = TPRoom(room, ranks, make_local() if group == 0 else None, self)
        return tp_room

    def create_sender(self, room: int) -> TPRoom:
        tp_room = self._open(room, lambda: self.local.create_sender(room))
        self.queue(tp_room, [Op.CREATE_SENDER])
        return tp_room

    def create_receiver(self, room: int, bootstrap_addr: str, dst_pages: list[int], num_tokens: int,
                        skip_pages: int = 0) -> TPRoom:
        tp_room = self._open(room, lambda: self.local.create_receiver(
            room, bootstrap_addr, dst_pages=dst_pages, num_tokens=num_tokens,
            skip_pages=skip_pages))
        self.queue(tp_room, [Op.CREATE_RECEIVER, num_tokens, skip_pages, *pack_str(bootstrap_addr),
                             len(dst_pages), *dst_pages])
        return tp_room

    def hold_rooms(self, rooms: list[tuple[int, str]]) -> None:
        self.local.hold_rooms(rooms)  # one decode rank's hold keeps a room on every prefill rank

    def take_finished(self) -> list[TPRoom]:
        """Send queued commands, gather every rank's ended rooms; rooms ended on all their
        ranks, once."""
        if not self._cmds and not self._live:
            return []  # nothing to say and nothing to hear: no collective while idle
        cmds, self._cmds = self._cmds, []
        self.channel.send(MessageKind.ROOMS,
                          torch.tensor(cmds, dtype=torch.int64) if cmds else None)
        reports = self.channel.all_gather_lists(report_of(self.local))
        for rank, values in enumerate(reports):
            for room, end in parse_report(values):
                self._record(rank, room, end)
        out = [r for r in self._live.values() if r.done]
        for r in out:
            del self._live[r.room]
            self._count(r)
        return out

    def _count(self, r: TPRoom) -> None:
        t, state, stats = self._totals, r.state, r.stats
        self._totals = dataclasses.replace(
            t, rooms_succeeded=t.rooms_succeeded + (state is RoomState.SUCCESS),
            rooms_failed=t.rooms_failed + (state is RoomState.FAILED),
            rooms_aborted=t.rooms_aborted + (state is RoomState.ABORTED),
            pages=t.pages + stats.pages, bytes=t.bytes + stats.bytes,
            writes=t.writes + stats.writes,
        )

    def _record(self, rank: int, room: int, end: _End) -> None:
        tp_room = self._live.get(room)
        if tp_room is None or rank not in tp_room.ranks:
            return
        tp_room.ends[rank] = end
        if end.state is not RoomState.SUCCESS and not tp_room.done:
            # One rank's room died: end it on the others now rather than at their deadlines.
            tp_room.abort(f"room ended on rank {rank}: {end.error}")

    def totals(self) -> TransferTotals:
        """Pages and bytes moved by every rank (rank 0's own manager counts only its share)."""
        return self._totals

    def room_counts(self) -> dict[str, int]:
        counts = {s.name: 0 for s in RoomState}
        for r in self._live.values():
            counts[r.state.name] += 1
        return counts

    def close(self) -> None:
        self.local.close()


def pack_float(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def unpack_float(v: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", v))[0])


def pack_first(f: FirstToken) -> list[int]:
    """[token or -1, has logprob, logprob bits, n top, (token, logprob bits)...]"""
    out = [-1 if f.token is None else f.token, int(f.logprob is not None),
           pack_float(f.logprob or 0.0), len(f.top)]
    for tok, lp in f.top:
        out += [tok, pack_float(lp)]
    return out


def unpack_first(values: list[int], at: int) -> tuple[FirstToken, int]:
    tok, has_lp, lp, n = values[at : at + 4]
    tops = values[at + 4 : at + 4 + 2 * n]
    top = [(tops[i], unpack_float(tops[i + 1])) for i in range(0, len(tops), 2)]
    return (FirstToken(None if tok < 0 else tok, unpack_float(lp) if has_lp else None, top),
            at + 4 + 2 * n)


def report_of(manager: KVTransferManager) -> list[int]:
    """This rank's rooms that ended since the last report:
    [room, state, pages, bytes, first token..., error]... (the first token: decode receivers)."""
    out: list[int] = []
    for r in manager.take_finished():
        first = FirstToken(getattr(r, "first_token", None), getattr(r, "first_logprob", None),
                           list(getattr(r, "top_logprobs", [])))
        out += [to_i64(r.room), _STATES.index(r.state), r.stats.pages, r.stats.bytes,
                *pack_first(first), *pack_str(r.error or "")]
    return out


def parse_report(values: list[int]) -> list[tuple[int, _End]]:
    out, at = [], 0
    while at < len(values):
        room, state, pages, nbytes = values[at : at + 4]
        first, at = unpack_first(values, at + 4)
        error, at = unpack_str(values, at)
        out.append((from_i64(room), _End(_STATES[state], error or None, pages, nbytes, first)))
    return out


# ---- followers -------------------------------------------------------------------------------


def rank_peer_id(config: WorkerConfig, dp_rank: int) -> str:
    """How prefill knows a rank across restarts: the worker's address (+ its DP group; the
    transfer manager appends the TP rank)."""
    base = f"{config.host}:{config.port}"
    return f"{base}/dp{dp_rank}" if config.parallel.dp_size > 1 else base


class FollowerRooms:
    """A follower's transfer manager (and bootstrap service on prefill), driven by rank 0's
    commands."""

    def __init__(self, config: WorkerConfig, kv: KVCache, num_kv_heads_total: int, fingerprint: str,
                 architecture: str, global_rank: int) -> None:
        self.dp_rank = global_rank // config.parallel.tp_size
        self.manager = KVTransferManager(
            config.transfer,
            transfer_layout(kv.shape, num_kv_heads_total, config.parallel.tp_rank,
                            config.parallel.tp_size),
            role=config.role, kv_ptr=kv.data_ptr(),
            kv_nbytes=kv.nbytes(), host=config.host, model_fingerprint=fingerprint,
            model_name=architecture, peer_id=rank_peer_id(config, self.dp_rank), tls=config.tls,
        )
        self.server: grpc.Server | None = None
        self.bootstrap_addr = ""
        if config.role == "prefill":
            want = config.transfer.bootstrap_port
            self.server, port = self.manager.serve_bootstrap(
                config.host, want + global_rank if want else 0)
            self.bootstrap_addr = f"{config.transfer.advertise_host or config.host}:{port}"
        self._rooms: dict[int, Room] = {}

    def apply(self, values: list[int]) -> None:
        at = 0
        while at < len(values):
            n = values[at]
            self._one(values[at + 1 : at + 1 + n])
            at += 1 + n

    def _one(self, cmd: list[int]) -> None:
        op, room, group, args = Op(cmd[0]), from_i64(cmd[1]), cmd[2], cmd[3:]
        if group != self.dp_rank:
            return  # a room of another DP group
        if op is Op.CREATE_SENDER:
            self._rooms[room] = self.manager.create_sender(room)
        elif op is Op.CREATE_RECEIVER:
            num_tokens, skip = args[0], args[1]
            addr, at = unpack_str(args, 2)
            pages = args[at + 1 : at + 1 + args[at]]
            self._rooms[room] = self.manager.create_receiver(room, addr, dst_pages=pages,
                                                             num_tokens=num_tokens, skip_pages=skip)
        elif op is Op.SEND:
            start, last = args[0], args[1]
            first, at = unpack_first(args, 2)
            n = args[at]
            self._rooms[room].send(args[at + 1 : at + 1 + n], start_page=start, last=bool(last),  # type: ignore[attr-defined]
                                   first_token=first.token, first_logprob=first.logprob,
                                   top_logprobs=first.top)
        elif op is Op.ABORT:
            self.manager.abort(room, unpack_str(args, 0)[0])

    def report(self) -> list[int]:
        rep = report_of(self.manager)
        for room, _ in parse_report(rep):
            self._rooms.pop(room, None)
        return rep

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1.0)
        self.manager.close()
