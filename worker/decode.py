"""The decode role: reserve pages, let prefill fill them, decode in the running batch.

Lifecycle of one request on a decode worker:
1. `Generate(room, bootstrap_addr)` arrives: a seat in the running batch and memory for the
   prompt (+ the first token) are reserved together in every cache group (pages; for a hybrid
   model also a window ring, where prefill lands its ring's tail); when seats or the cache are
   short the request waits here, holding nothing and before its first token, until they free
   up. (The gateway holds requests while every decode worker's seats are taken, so this queue
   is short; memory can still run out first.) While it waits, decode tells the prefill worker
   every third of transfer.bootstrap_timeout_s that the room is still wanted (HoldRoom), so
   prefill's room waits too instead of failing its bootstrapping deadline.
2. A receiver registers the room with the prefill worker's bootstrap service: destination
   pages, this worker's transfer agent, the layout contract and this incarnation's epoch.
   The request is WAITING_FOR_REMOTE_KV.
3. Prefill writes the pages and then reports the first token. `poll` sees the room succeed:
   the request takes its reserved seat in the running batch with its prompt marked computed
   and the first token appended, and streams from there. Decode never runs the prompt
   through the model.
4. If the room fails (deadline, peer gone, corrupt pages, contract mismatch) the request fails
   with that reason; it is never silently recomputed. Pages are freed exactly once.
5. A room that ended before DONE (abort, deadline, failure) may still have a prefill write in
   flight into its pages. The request ends at once (the client hears now), but its pages stay
   in quarantine, held by a `quarantine:<request id>` holder in the ledger, until the receiver
   is `quiesced` (prefill confirmed ReleaseRoom, or transfer_timeout_s passed); `poll` frees
   them then. Reusing them earlier would let a late write land in another request's KV.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from transfer.config import TransferConfig
from transfer.manager import KVReceiver, KVTransferManager
from transfer.room import RoomRequestError, RoomState, Side
from worker.cache_manager import CacheHold
from worker.request import DraftState, Request, RequestStatus, TokenLogprob, room_error_code
from worker.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Request
    sched: Scheduler  # of the DP group that will hold its pages


@dataclass
class _Room:
    request: Request
    receiver: KVReceiver
    sched: Scheduler


@dataclass
class _Quarantine:
    """Memory of an ended room, held until no prefill write can land in it any more."""

    receiver: KVReceiver
    sched: Scheduler  # of the DP group holding it
    hold: CacheHold  # under quarantine:<request id> in the ledgers


class DecodeRole:
    def __init__(self, manager: KVTransferManager, *, page_size: int,
                 hold_every_s: float = TransferConfig.bootstrap_timeout_s / 3) -> None:
        self.manager = manager
        self.page_size = page_size
        self.hold_every_s = hold_every_s  # HoldRoom for waiting rooms: a third of their deadline
        self._next_hold = 0.0  # monotonic time of the next HoldRoom round
        self._pending: deque[_Pending] = deque()  # no memory yet
        self._rooms: dict[str, _Room] = {}  # memory reserved, KV in flight (by request id)
        self._by_room: dict[int, _Room] = {}
        self._landed: deque[_Pending] = deque()  # KV here, waiting for a seat in the batch
        self._quarantined: list[_Quarantine] = []  # ended rooms prefill may still write into

    # ---- engine hooks ---------------------------------------------------------------------------
    def add_request(self, request: Request, scheduler: Scheduler) -> None:
        scheduler.expect_remote(request)
        self._pending.append(_Pending(request, scheduler))
        self._reserve()

    def on_prompt_done(self, request: Request) -> bool:
        # Decode requests arrive with their prompt done; recomputes after preemption keep decoding.
        return False

    def poll(self) -> None:
        self._free_quiesced()
        self._reserve()
        self._hold_waiting()
        for ended in self.manager.take_finished():  # each room exactly once
            room = self._by_room.pop(ended.room, None)
            if room is not None:
                del self._rooms[room.request.request_id]
                self._land(room, ended.state)
        self._seat()

    def _reserve(self) -> None:
        """Reserve memory for pending requests in arrival order; stop at the first that waits."""
        while self._pending:
            req, sched = self._pending[0].request, self._pending[0].sched
            num_tokens = req.num_prompt_tokens + 1  # the prompt and the first token
            if not sched.fits(num_tokens):
                self._pending.popleft()
                total = sched.stats().total_pages
                sched.finish(req, RequestStatus.FINISHED_ERROR,
                             f"prompt needs {-(-num_tokens // self.page_size)} KV pages, this "
                             f"decode worker has {total}; raise cache.max_total_tokens", "invalid")
                continue
            if not sched.reserve(req, num_tokens):
                return  # retry next step, in arrival order
            self._pending.popleft()
            held = sched.holdings(req)
            # Only hybrid models pass a ring or a state slot (multi-rank workers refuse them;
            # their manager facade in worker/rank_rooms.py takes neither).
            extra: dict[str, object] = {}
            if held.window_ring:
                extra["window_pages"] = held.window_ring
            if held.state_slot >= 0:
                extra["state_slot"] = held.state_slot
            try:
                receiver = self.manager.create_receiver(
                    req.room, req.bootstrap_addr, dst_pages=held.page_table,
                    num_tokens=req.num_prompt_tokens, **extra)  # type: ignore[arg-type]
            except RoomRequestError as exc:
                # a client's bad room (a repeated id, no bootstrap address): its request alone
                # fails, not the engine loop
                sched.finish(req, RequestStatus.FINISHED_ERROR, str(exc), "invalid")
                continue
            room = self._rooms[req.request_id] = _Room(req, receiver, sched)
            self._by_room[req.room] = room

    def _hold_waiting(self) -> None:
        """Requests still waiting for memory: their rooms stay wanted on prefill (HoldRoom)."""
        now = time.monotonic()
        if not self._pending or now < self._next_hold:
            return
        self._next_hold = now + self.hold_every_s
        self.manager.hold_rooms([(p.request.room, p.request.bootstrap_addr)
                                 for p in self._pending])

    def _land(self, room: _Room, state: RoomState) -> None:
        req, rx, sched = room.request, room.receiver, room.sched
        req.transfer_stats = dataclasses.asdict(rx.stats)
        if state is not RoomState.SUCCESS or rx.first_token is None:
            error = rx.error or f"room ended in state {state.name}"
            self._quarantine(req, rx, sched)
            sched.finish(req, RequestStatus.FINISHED_ERROR, f"KV transfer failed: {error}",
                         room_error_code(error, rx.fault, Side.DECODE, rx.timed_out))
            return
        logprob = None
        if rx.first_logprob is not None and (req.sampling.logprobs or req.sampling.top_logprobs):
            logprob = TokenLogprob(rx.first_token, rx.first_logprob, list(rx.top_logprobs))
        # A model drafter's KV for the prompt came in the pages; eagle/mtp's last feature with
        # the first token: its first drafts start there (worker/spec/drafter.py).
        hidden = getattr(rx, "draft_hidden", None)
        req.draft = DraftState(req.num_prompt_tokens,
                               torch.tensor(hidden) if hidden else None)
        if sched.land(req, rx.first_token, logprob):
            self._landed.append(_Pending(req, sched))

    def _seat(self) -> None:
        """Landed requests join their group's batch, in the seats they reserved."""
        self._landed = deque(p for p in self._landed if not p.sched.seat(p.request))

    def abort(self, request_id: str, reason: str) -> None:
        for queue in (self._pending, self._landed):
            for p in queue:
                if p.request.request_id == request_id:
                    queue.remove(p)
                    p.sched.finish(p.request, RequestStatus.FINISHED_ABORTED, reason,
                                   "unavailable")
                    return
        room = self._rooms.pop(request_id, None)
        if room is not None:
            del self._by_room[room.request.room]
            room.receiver.abort(reason)
            self._quarantine(room.request, room.receiver, room.sched)
            room.sched.finish(room.request, RequestStatus.FINISHED_ABORTED, reason, "unavailable")

    def _quarantine(self, req: Request, rx: KVReceiver, sched: Scheduler) -> None:
        """Keep `req`'s memory held past its end unless the receiver is already quiesced."""
        quiesced = rx.quiesced  # multi-rank rooms (worker/rank_rooms.py) answer for every rank
        if quiesced or not req.page_table:
            return
        hold = sched.hold(req, f"quarantine:{req.request_id}")
        self._quarantined.append(_Quarantine(rx, sched, hold))

    def _free_quiesced(self) -> None:
        """Give back the memory of quarantined rooms that prefill can no longer write."""
        still = []
        for q in self._quarantined:
            if q.receiver.quiesced:
                q.sched.release_hold(q.hold)
            else:
                still.append(q)
        self._quarantined = still

    @property
    def num_quarantined_pages(self) -> int:
        return sum(len(q.hold.pages) for q in self._quarantined)

    def has_work(self) -> bool:
        return bool(self._pending or self._rooms or self._landed or self._quarantined)

    def load_stats(self) -> tuple[dict[str, int], int, int, int]:
        totals = self.manager.totals()
        live = {state: n for state, n in self.manager.room_counts().items()
                if not RoomState[state].finished}
        return live, totals.bytes, totals.pages, len(self._pending) + len(self._landed)

    def close(self) -> None:
        self.manager.close()
