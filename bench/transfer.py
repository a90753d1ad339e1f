"""KV transfer throughput and per-room latency, per backend, next to the raw backend rate.

Moves a whole prompt's KV through the real path (bootstrap gRPC + manager + backend) between
a prefill and a decode manager in this process over loopback, and compares its GB/s with the
same backend writing one large buffer (64 MiB pieces) between the same two pools.

    .venv/bin/python bench/transfer.py [--backends mooncake,nixl] [--rooms 3] [--tokens 4096]
    .venv/bin/python bench/transfer.py --layouts 8b,8b-fp8  # FP8 KV's rooms beside bf16's

Decode pages are a shuffled set (the worst case: no two pages coalesce into one range).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from transfer.backend import TransferFaults  # noqa: E402
from transfer.config import TransferConfig  # noqa: E402
from transfer.contract import KVLayout  # noqa: E402
from transfer.manager import KVTransferManager  # noqa: E402
from transfer.plan import plan_pages, split_ranges  # noqa: E402
from transfer.room import RoomState  # noqa: E402

# an 8B-class GQA model (Llama-3-8B / Qwen3-8B shapes): 36 layers, 8 kv heads, head_dim 128, bf16
_8B = dict(num_layers=36, num_kv_heads_total=8, head_dim=128, dtype="bfloat16", page_size=16)
LAYOUTS = {
    "8b": _8B,
    # the same with FP8 KV (`cache.kv_cache_dtype: fp8_e4m3`): one byte an element
    "8b-fp8": _8B | dict(dtype="float8_e4m3fn"),
    # the embedded tiny model
    "tiny": dict(num_layers=4, num_kv_heads_total=2, head_dim=32, dtype="float32", page_size=16),
}
PIECES = (2 << 20, 16 << 20, 64 << 20)  # raw: the best of these range sizes is the ceiling


@dataclass
class Result:
    backend: str
    layout: str
    room_bytes: int
    pages: int
    raw_gbps: float
    kv_gbps: float
    transfer_ms: float  # send(last) -> decode SUCCESS, median over rooms
    room_ms: float  # decode create_receiver -> SUCCESS, median over rooms
    ranges: int  # backend ranges per room after coalescing


def _pair(
    backend: str, lay: KVLayout, checksum: bool
) -> tuple[KVTransferManager, KVTransferManager, grpc.Server, str, list[torch.Tensor]]:
    config = TransferConfig(
        backend=backend, checksum=checksum, transfer_timeout_s=60, waiting_timeout_s=60
    )  # type: ignore[arg-type]
    pools = [
        torch.ones(lay.pool_bytes, dtype=torch.uint8),
        torch.zeros(lay.pool_bytes, dtype=torch.uint8),
    ]
    pools[0].random_(0, 256)
    p = KVTransferManager(
        config,
        lay,
        role="prefill",
        kv_ptr=pools[0].data_ptr(),
        kv_nbytes=lay.pool_bytes,
        host="127.0.0.1",
        model_fingerprint="bench",
        faults=TransferFaults(),
    )
    d = KVTransferManager(
        config,
        lay,
        role="decode",
        kv_ptr=pools[1].data_ptr(),
        kv_nbytes=lay.pool_bytes,
        host="127.0.0.1",
        model_fingerprint="bench",
        faults=TransferFaults(),
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    p.add_to_server(server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return p, d, server, addr, pools


def _raw_spans(
    p: KVTransferManager, d: KVTransferManager, nbytes: int
) -> list[tuple[int, int, int]]:
    """The backend alone, pool to pool: the piece size with the best rate (one timed pass each)."""
    p.backend.connect(d.backend.agent_name, d.backend.agent_metadata)
    best: tuple[float, list[tuple[int, int, int]]] = (0.0, [])
    for piece in PIECES:
        spans = [
            (p.kv_ptr + off, d.kv_ptr + off, min(piece, nbytes - off))
            for off in range(0, nbytes, piece)
        ]
        p.backend.write(d.backend.agent_name, spans, 60)  # warm-up (handshake)
        rate = nbytes / _timed(lambda s=spans: p.backend.write(d.backend.agent_name, s, 60))  # type: ignore[misc]
        best = max(best, (rate, spans), key=lambda x: x[0])
    return best[1]


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _room(
    p: KVTransferManager, d: KVTransferManager, addr: str, room: int, dst: list[int], tokens: int
) -> tuple[float, float]:
    """One room through bootstrap + manager + backend:
    (send -> decode SUCCESS, create -> SUCCESS) seconds."""
    t0 = time.perf_counter()
    recv = d.create_receiver(room, addr, dst, num_tokens=tokens)
    send = p.create_sender(room)
    while send.poll() is RoomState.BOOTSTRAPPING:  # prefill computes while decode registers
        time.sleep(0.0002)
    t1 = time.perf_counter()
    send.send(list(range(len(dst) - 1)), start_page=0, last=True, first_token=1)
    while not recv.poll().finished:
        time.sleep(0.0002)
    t2 = time.perf_counter()
    assert recv.state is RoomState.SUCCESS, recv.error
    p.take_finished()
    d.take_finished()
    return t2 - t1, t2 - t0


def bench(
    backend: str, name: str, tokens: int, rooms: int, checksum: bool, shuffled: bool
) -> Result:
    """Alternate raw writes and rooms so that load on a shared machine hits both alike."""
    npages = -(-tokens // LAYOUTS[name]["page_size"])  # type: ignore[operator]
    lay = KVLayout(num_pages=npages + 1, **LAYOUTS[name])  # type: ignore[arg-type]
    p, d, server, addr, _pools = _pair(backend, lay, checksum)
    try:
        room_bytes = npages * lay.page_bytes
        spans = _raw_spans(p, d, room_bytes)
        rng = random.Random(0)
        raw_s, transfer_s, room_s = [], [], []
        for i in range(rooms + 1):  # room 0 warms the bootstrap channel up
            dst = (
                rng.sample(range(lay.num_pages), npages + 1)
                if shuffled
                else list(range(npages + 1))
            )
            raw = _timed(lambda: p.backend.write(d.backend.agent_name, spans, 60))
            transfer, room = _room(p, d, addr, i + 1, dst, tokens)
            if i:
                raw_s.append(raw)
                transfer_s.append(transfer)
                room_s.append(room)
        nranges = len(
            split_ranges(plan_pages(lay, lay, list(range(npages)), dst), p.backend.max_range_bytes)
        )
        raw_med, tm = statistics.median(raw_s), statistics.median(transfer_s)
        return Result(
            backend,
            name,
            room_bytes,
            npages,
            room_bytes / raw_med / 1e9,
            room_bytes / tm / 1e9,
            tm * 1e3,
            statistics.median(room_s) * 1e3,
            nranges,
        )
    finally:
        server.stop(None)
        p.close()
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backends", default="mooncake,nixl")
    ap.add_argument("--layouts", default="8b,tiny")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rooms", type=int, default=3)
    ap.add_argument(
        "--checksum", action="store_true", help="also crc32 every page group (prefill and decode)"
    )
    ap.add_argument(
        "--dst", default="shuffled,contiguous", help="decode page order(s): shuffled, contiguous"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=0.0,
        help="sys.setswitchinterval (s); Python's default 0.005 can delay each thread hand-off",
    )
    args = ap.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    print(
        "| backend | layout | dst pages | room MiB | pages | ranges | raw GB/s | KV GB/s | ratio "
        "| transfer ms | room ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for name in args.layouts.split(","):
            for order in args.dst.split(","):
                r = bench(
                    backend, name, args.tokens, args.rooms, args.checksum, order == "shuffled"
                )
                print(
                    f"| {r.backend} | {r.layout} | {order} | {r.room_bytes / 2**20:.1f} | "
                    f"{r.pages} | {r.ranges} | {r.raw_gbps:.2f} | {r.kv_gbps:.2f} | "
                    f"{r.kv_gbps / r.raw_gbps:.2f} | {r.transfer_ms:.1f} | {r.room_ms:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
