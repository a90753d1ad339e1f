"""One true two-process test per backend: prefill in a spawned process, decode here."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tests.transfer.helpers import layout, make_rank, page_bytes_of, wait_finished, wait_state
from tests.transfer.prefill_proc import serve_prefill
from transfer.config import TransferConfig
from transfer.room import RoomState

SEED = 7


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_two_processes_bit_exact_then_prefill_dies(backend: str) -> None:
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=serve_prefill, args=(backend, SEED, cmds, out), daemon=True)
    proc.start()
    decode = make_rank(
        "decode", layout(num_pages=16), TransferConfig(backend=backend, checksum=True)
    )  # type: ignore[arg-type]
    lay = layout(num_pages=16)
    # the child's pool, rebuilt from the same seed (helpers.make_rank fills prefill pools this way)
    child_pool = torch.randint(
        0, 256, (lay.pool_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED)
    )
    try:
        kind, addr = out.get(timeout=60)
        assert kind == "addr"
        src, dst = [3, 9, 4, 12], [1, 2, 0, 15, 7]
        recv = decode.manager.create_receiver(0xFEED, addr, dst, num_tokens=15)
        cmds.put(("room", 0xFEED, src, False))
        wait_finished([recv], timeout_s=30)
        assert recv.state is RoomState.SUCCESS, recv.error
        assert recv.first_token == 99 and recv.first_logprob == -0.125
        assert out.get(timeout=10)[:3] == ("done", 0xFEED, "SUCCESS")
        for s, d in zip(src, dst, strict=False):
            assert page_bytes_of(decode, d) == bytes(
                child_pool[s * lay.page_bytes : (s + 1) * lay.page_bytes].numpy()
            )

        # prefill dies mid-room: decode's stream breaks and the room fails at once
        recv2 = decode.manager.create_receiver(0xDEAD, addr, [5, 6], num_tokens=5)
        cmds.put(("room", 0xDEAD, [1], True))
        assert out.get(timeout=10) == ("holding", 0xDEAD)
        wait_state(recv2, RoomState.WAITING_FOR_INPUT)
        proc.kill()
        t0 = time.monotonic()
        wait_finished([recv2], timeout_s=5)
        assert recv2.state is RoomState.FAILED and "UNAVAILABLE" in (recv2.error or ""), recv2.error
        assert time.monotonic() - t0 < 2.0, "a dead prefill is noticed at once, not at a deadline"
        assert {r.room for r in decode.manager.take_finished()} == {0xFEED, 0xDEAD}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        decode.close()
