"""The decode role: reserve pages, let prefill fill them, decode in the running batch.

Lifecycle of one request on a decode worker:
1. `Generate(room, bootstrap_addr)` arrives: pages for the prompt (+ the first token) are
   reserved, and for a hybrid model a window ring (prefill lands its ring's tail there); when the pool is short the request waits here, holding nothing, until pages free up.
2. A receiver registers the room with the prefill worker's bootstrap service: destination
   pages, this worker's transfer agent, the layout contract and this incarnation's epoch.
   The request is WAITING_FOR_REMOTE_KV.
3. Prefill writes the pages and then reports the first token. `poll` sees the room succeed:
   the request joins the running batch with its prompt marked computed and the first token
   appended, and streams from there. Decode never runs the prompt through the model.
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
from collections import deque
from dataclasses import dataclass

from transfer.manager import KVReceiver, KVTransferManager
from transfer.room import RoomState
from worker.engine import Engine
from worker.page_pool import OutOfPages
from worker.request import Request, RequestStatus, TokenLogprob, room_error_code
from worker.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Room:
    request: Request
    receiver: KVReceiver


@dataclass
class _Quarantine:
    """Pages of an ended room, held until no prefill write can land in them any more."""

    receiver: KVReceiver
    sched: Scheduler  # of the DP group whose pool holds the pages
    pages: list[int]
    holder: str  # the ledger's name for this hold: quarantine:<request id>
    ring: list[int]  # window ring pages (hybrid models), held in the window pool the same way


class DecodeRole:
    def __init__(self, engine: Engine, manager: KVTransferManager) -> None:
        self.engine = engine
        self.manager = manager
        self.page_size = engine.kv.shape.page_size
        self._pending: deque[Request] = deque()  # no pages yet
        self._rooms: dict[str, _Room] = {}  # pages reserved, KV in flight (by request id)
        self._by_room: dict[int, _Room] = {}
        self._landed: deque[Request] = deque()  # KV here, waiting for a seat in the batch
        self._quarantined: list[_Quarantine] = []  # ended rooms whose pages prefill may still write

    # ---- engine hooks ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._pending.append(request)
        self._reserve()

    def on_prompt_done(self, request: Request) -> bool:
        return False  # decode requests arrive with their prompt done; recomputes after preemption keep decoding

    def poll(self) -> None:
        self._free_quiesced()
        self._reserve()
        for ended in self.manager.take_finished():  # each room exactly once
            room = self._by_room.pop(ended.room, None)
            if room is not None:
                del self._rooms[room.request.request_id]
                self._land(room, ended.state)
        self._seat()

    def _reserve(self) -> None:
        while self._pending:
            req = self._pending[0]
            sched = self.engine.scheduler_for(req)
            need = -(-(req.num_prompt_tokens + 1) // self.page_size)
            if need > sched.pool.num_pages:
                self._pending.popleft()
                sched.finish(req, RequestStatus.FINISHED_ERROR,
                             f"prompt needs {need} KV pages, this decode worker has {sched.pool.num_pages}", "invalid")
                continue
            window = sched.window
            if window is not None and sched.window_pool is not None and sched.window_pool.num_free < window.ring_pages:
                return  # no window ring free: retry next step, in arrival order
            try:
                pages = sched.pool.allocate(need, req.request_id)
            except OutOfPages:
                return  # retry next step, in arrival order
            self._pending.popleft()
            req.page_table = pages
            ring = sched.take_ring(req)  # hybrid models: prefill lands its window tail here
            assert ring is not None, "a free ring was checked above"
            # Only hybrid models pass a ring (multi-rank workers refuse them; their manager facade
            # in worker/rank_rooms.py takes no window_pages).
            if ring:
                receiver = self.manager.create_receiver(
                    req.room, req.bootstrap_addr, dst_pages=pages, num_tokens=req.num_prompt_tokens, window_pages=ring
                )
            else:
                receiver = self.manager.create_receiver(
                    req.room, req.bootstrap_addr, dst_pages=pages, num_tokens=req.num_prompt_tokens
                )
            room = self._rooms[req.request_id] = _Room(req, receiver)
            self._by_room[req.room] = room

    def _land(self, room: _Room, state: RoomState) -> None:
        req, rx = room.request, room.receiver
        req.transfer_stats = dataclasses.asdict(rx.stats)
        sched = self.engine.scheduler_for(req)
        if state is not RoomState.SUCCESS or rx.first_token is None:
            error = rx.error or f"room ended in state {state.name}"
            self._quarantine(req, rx)
            sched.finish(req, RequestStatus.FINISHED_ERROR, f"KV transfer failed: {error}", room_error_code(error))
            return
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_token_ids.append(rx.first_token)
        if rx.first_logprob is not None and (req.sampling.logprobs or req.sampling.top_logprobs):
            req.output_logprobs.append(TokenLogprob(rx.first_token, rx.first_logprob, list(rx.top_logprobs)))
        self.engine.emit(req)
        stop = sched.stop_status(req)
        if stop is not None:
            sched.finish(req, stop)
            return
        self._landed.append(req)

    def _seat(self) -> None:
        """Landed requests join their group's batch in arrival order while it has seats."""
        waiting: deque[Request] = deque()
        for req in self._landed:
            sched = self.engine.scheduler_for(req)
            if len(sched.running) < sched.config.max_num_seqs:
                req.status = RequestStatus.RUNNING
                sched.running.append(req)
            else:
                waiting.append(req)
        self._landed = waiting

    def abort(self, request_id: str, reason: str) -> None:
        for req in list(self._pending) + list(self._landed):
            if req.request_id == request_id:
                (self._pending if req in self._pending else self._landed).remove(req)
                self.engine.scheduler_for(req).finish(req, RequestStatus.FINISHED_ABORTED, reason, "unavailable")
                return
        room = self._rooms.pop(request_id, None)
        if room is not None:
            del self._by_room[room.request.room]
            room.receiver.abort(reason)
            self._quarantine(room.request, room.receiver)
            self.engine.scheduler_for(room.request).finish(room.request, RequestStatus.FINISHED_ABORTED, reason,
                                                           "unavailable")

    def _quarantine(self, req: Request, rx: KVReceiver) -> None:
        """Keep `req`'s pages held past its end unless the receiver is already quiesced."""
        quiesced = rx.quiesced  # multi-rank rooms (worker/rank_rooms.py) answer for every rank
        if quiesced or not req.page_table:
            return
        holder = f"quarantine:{req.request_id}"
        sched = self.engine.scheduler_for(req)
        sched.pool.share(req.page_table, holder)
        ring = list(sched.rings.get(req.request_id, []))
        if ring:
            assert sched.window_pool is not None
            sched.window_pool.share(ring, holder)
        self._quarantined.append(_Quarantine(rx, sched, list(req.page_table), holder, ring))

    def _free_quiesced(self) -> None:
        """Give back the pages of quarantined rooms that prefill can no longer write."""
        if not self._quarantined:
            return
        still = []
        for q in self._quarantined:
            if q.receiver.quiesced:
                q.sched.pool.release(q.pages, q.holder)
                if q.ring:
                    assert q.sched.window_pool is not None
                    q.sched.window_pool.release(q.ring, q.holder)
            else:
                still.append(q)
        self._quarantined = still

    @property
    def num_quarantined_pages(self) -> int:
        return sum(len(q.pages) for q in self._quarantined)

    def has_work(self) -> bool:
        return bool(self._pending or self._rooms or self._landed or self._quarantined)

    def load_stats(self) -> tuple[dict[str, int], int, int, int]:
        totals = self.manager.totals()
        live = {state: n for state, n in self.manager.room_counts().items() if not RoomState[state].finished}
        return live, totals.bytes, totals.pages, len(self._pending) + len(self._landed)

    def close(self) -> None:
        self.manager.close()
