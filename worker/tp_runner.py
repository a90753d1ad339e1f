"""Multi-rank workers at run time: rank 0's leader, the follower loop, and rooms on every rank.

Rank 0 (`TPLeader`): spawns its node's follower ranks, joins the process group, and
broadcasts each step's batch before its own forward (`ModelRunner.before_forward`). In PD
roles it wraps its `KVTransferManager` in a `TPTransferManager`: the roles keep calling
create_sender / create_receiver / take_finished as on one rank, and the facade repeats each
room command on every follower (same room id, same page ids) and merges the ranks' end
states — a room succeeds only when it succeeded on every rank.

Followers (`follower_main`): load their shard, allocate the same KV pool, open their own
transfer manager (and bootstrap service on prefill), then obey rank 0's messages until STOP.
They never schedule and never sample.

Room commands and reports travel as int64 lists (see worker/distributed.py for why).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from transfer.contract import KVLayout
from transfer.manager import KVTransferManager
from transfer.room import Room, RoomState, RoomStats, TransferTotals
from worker.batch import ForwardBatch
from worker.config import WorkerConfig
from worker.distributed import (
    DistributedError,
    MessageKind,
    StepChannel,
    from_i64,
    init_process_group,
    pack_batch,
    pack_str,
    place,
    rank_config,
    spawn_local_ranks,
    to_i64,
    unpack_batch,
    unpack_str,
    with_init_addr,
)
from worker.dp_runner import follow_dp_step
from worker.kv_cache import KVCache
from worker.model.base import CausalLM, WeightSlot

log = logging.getLogger(__name__)

_STATES = list(RoomState)


class Op(enum.IntEnum):
    CREATE_SENDER = 1
    CREATE_RECEIVER = 2
    SEND = 3
    ABORT = 4


# ---- rank 0 ----------------------------------------------------------------------------------


class TPLeader:
    """Rank 0's side of a multi-rank worker: followers, process group, step broadcast."""

    def __init__(self, config: WorkerConfig) -> None:
        config = with_init_addr(config)
        self.config = config
        where = place(config.parallel, 0)
        if where.global_rank != 0:
            raise DistributedError("TPLeader runs on node 0's first rank; other nodes run run_node()")
        self.procs = spawn_local_ranks(config, first_local_rank=1)
        init_process_group(config.parallel, where)
        self.channel = StepChannel(torch.device(config.parallel.device))
        self._closed = False

    def broadcast_batch(self, batch: ForwardBatch) -> None:
        """Before rank 0's forward: every follower runs the same batch on its shard."""
        self.channel.send(MessageKind.STEP, pack_batch(batch))

    def wrap_model(self, model: CausalLM) -> CausalLM:
        return LeaderModel(model, self)

    def wrap_manager(self, manager: KVTransferManager, bootstrap_addr: str,
                     group_of_room: Callable[[int], int]) -> tuple[TPTransferManager, str]:
        """Rooms on the ranks of their DP group; returns the facade and every rank's bootstrap
        address (rank order; DP groups separated by ';')."""
        tp = self.config.parallel.tp_size
        addrs = exchange_bootstrap_addrs(self.channel, bootstrap_addr, tp)
        return TPTransferManager(manager, self.channel, tp, group_of_room), addrs

    def close(self, timeout_s: float = 30.0) -> None:
        """STOP the followers and wait for them (rank 0's engine thread has stopped stepping)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.send(MessageKind.STOP)
        finally:
            for p in self.procs:
                p.join(timeout=timeout_s)
                if p.is_alive():
                    log.error("rank process %s did not stop in %.0f s; terminating it", p.name, timeout_s)
                    p.terminate()
            dist.destroy_process_group()


class LeaderModel(CausalLM):
    """Rank 0's model: broadcasts each batch to the followers, then runs its own shard.

    Wrapping the model (rather than the runner) keeps the single-rank runner untouched; every
    forward the runner makes is mirrored on every rank, in order. (CUDA-graph replay bypasses
    forward, so a multi-rank worker must not enable decode graphs.)
    """

    def __init__(self, inner: CausalLM, leader: TPLeader) -> None:
        super().__init__()
        self.inner = inner
        self._leader = leader

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        self._leader.broadcast_batch(batch)
        return self.inner(batch, kv)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    @property
    def supports_cuda_graphs(self) -> bool:
        return False  # a replayed graph would skip the broadcast: the followers would never step

    def weight_slots(self) -> dict[str, WeightSlot]:
        return self.inner.weight_slots()


def exchange_bootstrap_addrs(channel: StepChannel, mine: str, tp_size: int) -> str:
    """All ranks: every rank's bootstrap address, comma-separated in rank order, DP groups
    separated by ';' ("" on decode)."""
    addrs = [bytes(v[1:]).decode() for v in channel.all_gather_lists(pack_str(mine))]
    if not all(addrs):
        return ""
    return ";".join(",".join(addrs[g : g + tp_size]) for g in range(0, len(addrs), tp_size))


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
    def send(self, src_pages: list[int], *, start_page: int, last: bool, first_token: int | None = None,
             first_logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None,
             **rest: object) -> None:
        """Ship pages from every rank of the room's group, each its own heads. The group's first
        rank's first token (and logprobs) is the one decode keeps."""
        if self.local is not None:
            self.local.send(src_pages, start_page=start_page, last=last, first_token=first_token,  # type: ignore[attr-defined]
                            first_logprob=first_logprob, top_logprobs=top_logprobs, **rest)
        first = FirstToken(first_token, first_logprob, list(top_logprobs or []))
        self.facade.queue(self, [Op.SEND, start_page, int(last), *pack_first(first), len(src_pages), *src_pages])

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


class TPTransferManager:
    """What the PD roles see on rank 0 of a multi-rank worker (the same calls as one rank's manager).

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
            room, bootstrap_addr, dst_pages=dst_pages, num_tokens=num_tokens, skip_pages=skip_pages))
        self.queue(tp_room, [Op.CREATE_RECEIVER, num_tokens, skip_pages, *pack_str(bootstrap_addr),
                             len(dst_pages), *dst_pages])
        return tp_room

    def take_finished(self) -> list[TPRoom]:
        """Send queued commands, gather every rank's ended rooms; rooms ended on all their ranks, once."""
        if not self._cmds and not self._live:
            return []  # nothing to say and nothing to hear: no collective while idle
        cmds, self._cmds = self._cmds, []
        self.channel.send(MessageKind.ROOMS, torch.tensor(cmds, dtype=torch.int64) if cmds else None)
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
            pages=t.pages + stats.pages, bytes=t.bytes + stats.bytes, writes=t.writes + stats.writes,
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
    out = [-1 if f.token is None else f.token, int(f.logprob is not None), pack_float(f.logprob or 0.0), len(f.top)]
    for tok, lp in f.top:
        out += [tok, pack_float(lp)]
    return out


def unpack_first(values: list[int], at: int) -> tuple[FirstToken, int]:
    tok, has_lp, lp, n = values[at : at + 4]
    tops = values[at + 4 : at + 4 + 2 * n]
    top = [(tops[i], unpack_float(tops[i + 1])) for i in range(0, len(tops), 2)]
    return FirstToken(None if tok < 0 else tok, unpack_float(lp) if has_lp else None, top), at + 4 + 2 * n


def report_of(manager: KVTransferManager) -> list[int]:
    """This rank's rooms that ended since the last report:
    [room, state, pages, bytes, first token..., error]... (the first token: decode receivers)."""
    out: list[int] = []
    for r in manager.take_finished():
        first = FirstToken(getattr(r, "first_token", None), getattr(r, "first_logprob", None),
                           list(getattr(r, "top_logprobs", [])))
        out += [to_i64(r.room), _STATES.index(r.state), r.stats.pages, r.stats.bytes, *pack_first(first),
                *pack_str(r.error or "")]
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


def kv_layout_of(kv: KVCache, num_kv_heads_total: int, config: WorkerConfig) -> KVLayout:
    shape = kv.shape
    return KVLayout(
        num_pages=shape.num_pages, num_layers=shape.num_layers, page_size=shape.page_size, head_dim=shape.head_dim,
        dtype=str(shape.dtype).removeprefix("torch."), num_kv_heads_total=num_kv_heads_total,
        tp_rank=config.parallel.tp_rank, tp_size=config.parallel.tp_size,
    )


def rank_peer_id(config: WorkerConfig, dp_rank: int) -> str:
    """How prefill knows a rank across restarts: the worker's address (+ its DP group; the
    transfer manager appends the TP rank)."""
    base = f"{config.host}:{config.port}"
    return f"{base}/dp{dp_rank}" if config.parallel.dp_size > 1 else base


class FollowerRooms:
    """A follower's transfer manager (and bootstrap service on prefill), driven by rank 0's commands."""

    def __init__(self, config: WorkerConfig, kv: KVCache, num_kv_heads_total: int, fingerprint: str,
                 architecture: str, global_rank: int) -> None:
        self.dp_rank = global_rank // config.parallel.tp_size
        self.manager = KVTransferManager(
            config.transfer, kv_layout_of(kv, num_kv_heads_total, config), role=config.role, kv_ptr=kv.data_ptr(),
            kv_nbytes=kv.nbytes(), host=config.host, model_fingerprint=fingerprint, model_name=architecture,
            peer_id=rank_peer_id(config, self.dp_rank), tls=config.tls,
        )
        self.server: grpc.Server | None = None
        self.bootstrap_addr = ""
        if config.role == "prefill":
            from protocol.tls import add_port
            from worker.roles import MAX_LIVE_ROOMS

            self.server = grpc.server(ThreadPoolExecutor(max_workers=MAX_LIVE_ROOMS, thread_name_prefix="bootstrap"))
            self.manager.add_to_server(self.server)
            want = config.transfer.bootstrap_port
            port = add_port(self.server, f"{config.host}:{want + global_rank if want else 0}", config.tls)
            if port == 0:
                raise DistributedError(f"rank {global_rank}: cannot bind a bootstrap port on {config.host}")
            self.server.start()
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
            self._rooms[room] = self.manager.create_receiver(room, addr, dst_pages=pages, num_tokens=num_tokens,
                                                             skip_pages=skip)
        elif op is Op.SEND:
            start, last = args[0], args[1]
            first, at = unpack_first(args, 2)
            n = args[at]
            self._rooms[room].send(args[at + 1 : at + 1 + n], start_page=start, last=bool(last),  # type: ignore[attr-defined]
                                   first_token=first.token, first_logprob=first.logprob, top_logprobs=first.top)
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


def _exit_with_parent(parent_pid: int) -> None:
    """A follower must not outlive the process that spawned it (no orphaned rank holding a GPU)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def follower_main(config: WorkerConfig, local_rank: int, parent_pid: int) -> None:
    """Entry point of a follower rank process (spawned by `spawn_local_ranks`)."""
    from worker.engine import kv_shape
    from worker.model import load_model

    where = place(config.parallel, local_rank)
    cfg = rank_config(config, where)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {cfg.role} rank{where.global_rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    init_process_group(cfg.parallel, where)
    rooms: FollowerRooms | None = None
    try:
        device = torch.device(cfg.parallel.device)
        model, spec = load_model(cfg.model, cfg.parallel)
        kv = KVCache(kv_shape(spec, cfg, cfg.cache.total_pages), device)
        channel = StepChannel(device)
        if cfg.role != "both":
            rooms = FollowerRooms(cfg, kv, spec.num_kv_heads, spec.fingerprint, spec.architecture, where.global_rank)
            exchange_bootstrap_addrs(channel, rooms.bootstrap_addr, cfg.parallel.tp_size)
        serve_follower(channel, model, kv, rooms, device, cfg.parallel.tp_size)
    finally:
        if rooms is not None:
            rooms.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def serve_follower(channel: StepChannel, model: CausalLM, kv: KVCache, rooms: FollowerRooms | None,
                   device: torch.device, tp_size: int) -> None:
    """Obey rank 0 until STOP: forwards on our shard, room commands, reports."""
    while True:
        kind, payload = channel.recv()
        if kind is MessageKind.DP_STEP:
            assert payload is not None
            follow_dp_step(payload, model, kv, device, channel, tp_size)
        elif kind is MessageKind.STEP:
            assert payload is not None
            batch = unpack_batch(payload, device)
            hidden = model(batch, kv)  # [T, hidden]
            if batch.logits_indices.numel():
                model.compute_logits(hidden[batch.logits_indices])  # type: ignore[operator]  # joins the vocab gather
        elif kind is MessageKind.ROOMS:
            if rooms is None:
                raise DistributedError("rank 0 sent room commands to a worker with role 'both'")
            rooms.apply([] if payload is None else payload.tolist())
            channel.all_gather_lists(rooms.report())
        else:
            return


def run_node(config: WorkerConfig) -> None:
    """`tandem worker --node-rank k` (k > 0): run this node's ranks until they exit; serves nothing."""
    par = config.parallel
    if par.node_rank == 0:
        raise DistributedError("run_node is for nodes 1..nnodes-1; node 0 runs the worker server (run_worker)")
    procs = spawn_local_ranks(config, first_local_rank=0)
    codes = []
    for p in procs:
        p.join()
        codes.append(p.exitcode)
    if any(codes):
        raise DistributedError(f"node {par.node_rank}: rank processes exited with codes {codes}")
