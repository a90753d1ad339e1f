"""A prefill rank in its own process (multiprocessing spawn), driven over queues by a test."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from tests.transfer.helpers import layout, make_rank, wait_finished
from transfer.config import TransferConfig


def serve_prefill(backend: str, seed: int, cmds: mp.Queue, out: mp.Queue) -> None:
    """Serve bootstrap; for each ("room", id, src_pages, hold) send the pages, report the state."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    rank = make_rank(
        "prefill", layout(num_pages=16), TransferConfig(backend=backend, checksum=True), seed=seed
    )  # type: ignore[arg-type]
    out.put(("addr", rank.addr))
    try:
        while (cmd := cmds.get(timeout=60))[0] != "stop":
            _, room, src_pages, hold = cmd
            sender = rank.manager.create_sender(room)
            if hold:  # stay in WAITING_FOR_INPUT until the test kills this process
                out.put(("holding", room))
                time.sleep(60)
            sender.send(src_pages, start_page=0, last=True, first_token=99, first_logprob=-0.125)
            wait_finished([sender])
            out.put(("done", room, sender.state.name, sender.error, sender.stats.bytes))
    finally:
        rank.close()
