"""The prefill role: compute prompts, ship their KV to the decode worker that reserved pages.

Lifecycle of one request on a prefill worker:
1. `Generate(room, bootstrap_addr)` arrives: a sender is opened for the room (state
   BOOTSTRAPPING until the decode worker registers its destination pages) and the request
   joins the waiting queue like any other.
2. The scheduler computes the prompt in chunks; the prefix cache may skip cached pages.
   With `transfer.layerwise_interval = N > 0`, every N chunks the pages the prompt has filled
   so far are shipped while the next chunks compute. Those pages are held for the room
   (`send:<request id>`) until it ends: the writes read them later, and a preemption meanwhile
   must not let another request overwrite them.
3. The last chunk samples the first token. The request leaves the running batch (the
   scheduler marks it TRANSFERRING) and its remaining pages, the first token and its logprobs
   are shipped — for a hybrid model
   also the retained tail of its window ring (docs/hybrid-cache.md); with a speculative
   eagle/mtp head, its last feature (its KV rides in the pages); the room completes once
   every write is confirmed. A prefix hit on a hybrid model re-feeds a bounded suffix first
   (the scheduler's bounded replay), so the ring it ships is exact.
4. `poll` (every step) sees the room end: success → the request finishes and its pages go back
   to the pool through the prefix cache; failure or abort → the request fails with the room's
   reason. Pages are freed exactly once, here or by an abort, and the room's holds with them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import grpc

from transfer.manager import KVSender, KVTransferManager
from transfer.room import RoomRequestError, RoomState, Side
from worker.cache_manager import CacheHold
from worker.request import Request, RequestStatus, room_error_code
from worker.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Room:
    request: Request
    sender: KVSender
    sched: Scheduler  # of the DP group computing the prompt
    pages_sent: int = 0  # leading pages of page_table already handed to the sender
    chunks_since_send: int = 0
    holds: list[CacheHold] = dataclasses.field(default_factory=list)  # layer-wise pages sent

    def release(self) -> None:
        for hold in self.holds:
            self.sched.release_hold(hold)
        self.holds.clear()


def _feature(request: Request) -> list[float] | None:
    state = request.draft
    if state is None or state.feature is None:
        return None
    return state.feature.float().tolist()  # type: ignore[no-any-return]


class PrefillRole:
    def __init__(self, manager: KVTransferManager, bootstrap: grpc.Server, *, page_size: int,
                 layerwise_interval: int) -> None:
        self.manager = manager
        self.bootstrap = bootstrap  # the bootstrap service's server, stopped on close
        self.page_size = page_size
        self.layerwise_interval = layerwise_interval
        self._rooms: dict[str, _Room] = {}  # by request id: every request here has a room
        self._by_room: dict[int, _Room] = {}

    # ---- engine hooks ---------------------------------------------------------------------------
    def add_request(self, request: Request, scheduler: Scheduler) -> None:
        try:
            sender = self.manager.create_sender(request.room)
        except RoomRequestError as exc:
            # a client's bad room (a repeated id, no bootstrap address): its request alone
            # fails, not the engine loop
            scheduler.finish(request, RequestStatus.FINISHED_ERROR, str(exc), "invalid")
            return
        room = self._rooms[request.request_id] = _Room(request, sender, scheduler)
        self._by_room[request.room] = room
        scheduler.add(request)

    def on_prompt_done(self, request: Request) -> bool:
        room = self._rooms[request.request_id]
        first = request.output_logprobs[0] if request.output_logprobs else None
        held = room.sched.holdings(request)
        state = {"state_slot": held.state_slot} if held.state_slot >= 0 else {}
        room.sender.send(
            held.page_table[room.pages_sent :],
            start_page=room.pages_sent,
            last=True,
            first_token=request.output_token_ids[0],
            first_logprob=first.logprob if first else None,
            top_logprobs=first.top if first else None,
            # Hybrid models: the window ring's retained tail travels too (decode never re-feeds).
            window_ring=held.window_ring or None,
            num_tokens=request.num_computed_tokens,
            # Speculative eagle/mtp: the draft head's last feature, where decode's drafts start.
            draft_hidden=_feature(request),
            **state,  # type: ignore[arg-type]  # recurrent models: the state after the prompt
        )
        room.pages_sent = len(held.page_table)
        return True

    def after_step(self) -> None:
        """Layer-wise overlap: ship the full pages finished so far, every N chunks."""
        if self.layerwise_interval <= 0:
            return
        for room in self._rooms.values():
            req = room.request
            if req.status is not RequestStatus.RUNNING or req.output_token_ids:
                continue
            room.chunks_since_send += 1
            full = req.num_computed_tokens // self.page_size
            if room.chunks_since_send >= self.layerwise_interval and full > room.pages_sent:
                pages = req.page_table[room.pages_sent : full]
                room.holds.append(room.sched.hold_pages(pages, f"send:{req.request_id}"))
                room.sender.send(pages, start_page=room.pages_sent, last=False)
                room.pages_sent = full
                room.chunks_since_send = 0

    def poll(self) -> None:
        self.after_step()
        for ended in self.manager.take_finished():  # each room exactly once
            room = self._by_room.pop(ended.room, None)
            if room is None:  # aborted by us already
                continue
            req = room.request
            del self._rooms[req.request_id]
            room.release()
            req.transfer_stats = dataclasses.asdict(room.sender.stats)
            error = room.sender.error or ""
            if req.status is RequestStatus.TRANSFERRING:
                self._end(room, ended.state, error)
            else:  # the room died before the prompt was done
                error = error or f"room ended ({ended.state.name}) before the prompt finished"
                room.sched.end(req.request_id, RequestStatus.FINISHED_ERROR, error,
                               self._code(room, error))

    def _code(self, room: _Room, error: str) -> str:
        s = room.sender
        return room_error_code(error, s.fault, Side.PREFILL, s.timed_out)

    def _end(self, room: _Room, state: RoomState, error: str) -> None:
        req, sched = room.request, room.sched
        if state is RoomState.SUCCESS:
            sched.finish(req, RequestStatus.FINISHED_STOPPED)
        elif state is RoomState.ABORTED:
            sched.finish(req, RequestStatus.FINISHED_ABORTED,
                         error or "aborted by the decode side", "unavailable")
        else:
            sched.finish(req, RequestStatus.FINISHED_ERROR, f"KV transfer failed: {error}",
                         self._code(room, error))

    def abort(self, request_id: str, reason: str) -> None:
        room = self._rooms.pop(request_id, None)
        if room is None:
            return
        del self._by_room[room.request.room]
        room.sender.abort(reason)
        room.release()
        if room.request.status is RequestStatus.TRANSFERRING:  # out of the scheduler's queues
            room.sched.finish(room.request, RequestStatus.FINISHED_ABORTED, reason, "unavailable")

    def has_work(self) -> bool:
        return bool(self._rooms)

    def load_stats(self) -> tuple[dict[str, int], int, int, int]:
        totals = self.manager.totals()
        live = {state: n for state, n in self.manager.room_counts().items()
                if not RoomState[state].finished}
        return live, totals.bytes, totals.pages, 0

    def close(self) -> None:
        self.bootstrap.stop(grace=1.0)
        self.manager.close()
