"""cuda_ipc page gather vs the copy ceilings, one GPU and two (issue 23).

    python3 bench/page_gather.py [--tokens 3072] [--repeats 10] [--layout 8b] [--out DIR]

A spawned process exports a decode pool (GPU 0, then GPU 1 when two are visible); this process
writes one prompt's KV into it through `CudaIpcBackend`, the real path: IPC mapping, the wait on
the default stream, the gather kernel (or one cuMemcpyAsync per span, `CopyPath.MEMCPY`), the
event that `poll` reads. Each case is timed submit → DONE, median of --repeats ("room ms"), and
back to back (--repeats rooms submitted, then the last one awaited: the rate once the host's
part overlaps the device's). Cases, all on the same bytes:

- `ceiling`: torch `copy_` of the room's bytes as one tensor: on GPU 0 (device to device), and
  GPU 0 → GPU 1 (the peer copy over NVLink) for the two-GPU placement;
- `one range`: the room as one contiguous range;
- `shuffled pages`: the room's pages into shuffled decode pages (no two pages coalesce);
- `head slices`: prefill TP 1 → decode TP 2's rank 0: half the kv heads of every (page, layer,
  K|V), the spans of heterogeneous TP (transfer/plan.py).

Then the kernel alone (`sweep`), in this process over torch tensors, timed with CUDA events
(no host part): the shuffled-pages room with a few (chunk, block, warps) settings, so the
defaults in transfer/page_gather.py can be set from one call.

GB/s are bytes moved (the room's size) per second; the ceiling is the same. Every case is
verified once: the decode process checksums the bytes its spans cover. Writes page_gather.json
and page_gather.md to --out (default $OUT or the current directory).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfer.backend import WriteStatus  # noqa: E402
from transfer.contract import KVLayout  # noqa: E402
from transfer.cuda_ipc import CopyPath, CudaIpcBackend  # noqa: E402
from transfer.plan import plan_pages  # noqa: E402

LAYOUTS = {  # KV pages as the workers lay them out (worker/kv_cache.py)
    "8b": dict(num_layers=36, num_kv_heads_total=8, head_dim=128, dtype="bfloat16", page_size=16),
    "tiny": dict(num_layers=4, num_kv_heads_total=2, head_dim=32, dtype="float32", page_size=16),
}
Span = tuple[int, int, int]


def _checksum(data: torch.Tensor) -> int:
    """Order-sensitive sum of a byte tensor (equal bytes in another order differ)."""
    weights = torch.arange(data.numel(), device=data.device, dtype=torch.int64) % 251 + 1
    return int((data.to(torch.int64) * weights).sum())


def _decode_pool(device: str, nbytes: int, cmds: mp.Queue, out: mp.Queue) -> None:
    """Child: a zeroed pool exported through cuda_ipc; ("sum", [(offset, n)]) checksums them."""
    pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    backend = CudaIpcBackend("bench-decode")
    backend.register(pool.data_ptr(), nbytes)
    out.put((backend.agent_name, backend.agent_metadata, pool.data_ptr()))
    try:
        while (cmd := cmds.get(timeout=600))[0] != "stop":
            torch.cuda.synchronize()
            if cmd[0] == "zero":
                pool.zero_()
                torch.cuda.synchronize()
                out.put("ok")
            else:
                out.put(_checksum(torch.cat([pool[o:o + n] for o, n in cmd[1]])))
    finally:
        backend.close()


def ceiling(src_device: str, dst_device: str, nbytes: int, repeats: int) -> float:
    """Bytes moved per second by one torch copy_ of `nbytes` (median of `repeats`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(src_device)
        torch.cuda.synchronize(dst_device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


def cases(layout: str, tokens: int, src: int, dst: int) -> dict[str, tuple[int, list[Span]]]:
    """name → (bytes, spans) of one room, addresses absolute (src pool, dst pool)."""
    lay = KVLayout(num_pages=1, **LAYOUTS[layout])  # type: ignore[arg-type]
    pages = -(-tokens // lay.page_size)
    full = KVLayout(num_pages=2 * pages, **LAYOUTS[layout])  # type: ignore[arg-type]
    half = KVLayout(num_pages=2 * pages, tp_rank=0, tp_size=2,  # decode TP 2's rank 0
                    **LAYOUTS[layout])  # type: ignore[arg-type]
    rng = random.Random(0)
    src_pages = rng.sample(range(2 * pages), pages)
    dst_pages = rng.sample(range(2 * pages), pages)

    def spans(to: KVLayout, dst_ids: list[int], from_ids: list[int]) -> list[Span]:
        return [(src + r.src, dst + r.dst, r.length)
                for r in plan_pages(full, to, from_ids, dst_ids)]

    room = pages * full.page_bytes
    return {
        "one range": (room, [(src, dst, room)]),
        "shuffled pages": (room, spans(full, dst_pages, src_pages)),
        "head slices": (room // 2, spans(half, dst_pages, src_pages)),
    }


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _back_to_back_ms(backend: CudaIpcBackend, peer: str, spans: list[Span], repeats: int) -> float:
    """Per room, with `repeats` rooms submitted before the last one is awaited."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    handles = [backend.submit(peer, spans) for _ in range(repeats)]
    for h in handles:
        while backend.poll(h) is not WriteStatus.DONE:
            time.sleep(0)
    dt = (time.perf_counter() - t) / repeats
    for h in handles:
        backend.release(h)
    return dt * 1e3


def placement(dst_device: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every case and copy path into a decode pool on `dst_device`, written from GPU 0."""
    lay = KVLayout(num_pages=1, **LAYOUTS[args.layout])  # type: ignore[arg-type]
    pages = -(-args.tokens // lay.page_size)
    nbytes = 2 * pages * lay.page_bytes
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_decode_pool, args=(dst_device, nbytes, cmds, out), daemon=True)
    proc.start()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    room = pages * lay.page_bytes
    top = ceiling("cuda:0", dst_device, room, args.repeats)
    res: dict[str, Any] = {"dst": dst_device, "room_bytes": room, "pages": pages,
                           "page_bytes": lay.page_bytes, "ceiling_GBps": round(top, 1)}
    try:
        name, meta, dst = out.get(timeout=120)
        for path in (CopyPath.KERNEL, CopyPath.MEMCPY):
            backend = CudaIpcBackend("bench-prefill", copy_path=path)
            try:
                backend.register(src.data_ptr(), nbytes)
                backend.connect(name, meta)
                rooms = cases(args.layout, args.tokens, src.data_ptr(), dst)
                for case, (nbytes_case, spans) in rooms.items():
                    res[f"{case} / {path.value}"] = _case(backend, name, nbytes_case, spans, src,
                                                          dst, cmds, out, args.repeats)
                    print(f"[page_gather] {dst_device} {case} / {path.value}: "
                          f"{res[f'{case} / {path.value}']}", flush=True)
            finally:
                backend.close()
        cmds.put(("stop",))
        return res
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _case(backend: CudaIpcBackend, peer: str, room: int, spans: list[Span], src: torch.Tensor,
          dst: int, cmds: mp.Queue, out: mp.Queue, repeats: int) -> dict[str, Any]:
    cmds.put(("zero",))
    assert out.get(timeout=60) == "ok"
    backend.write(peer, spans, 60)  # warm-up, and the bytes to verify
    cmds.put(("sum", [(d - dst, n) for _, d, n in spans]))
    base = src.data_ptr()
    want = _checksum(torch.cat([src[s - base:s - base + n] for s, _, n in spans]))
    verified = out.get(timeout=120) == want
    ms = _median_ms(lambda: backend.write(peer, spans, 60), repeats)
    b2b = _back_to_back_ms(backend, peer, spans, repeats)
    return {"spans": len(spans), "room_ms": round(ms, 3), "GBps": round(room / ms / 1e6, 1),
            "back_to_back_GBps": round(room / b2b / 1e6, 1), "verified": verified}


SWEEP = ((16384, 2048, 4), (16384, 1024, 4), (32768, 2048, 8), (8192, 2048, 4), (65536, 4096, 8))


def kernel_sweep(dst_device: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The gather kernel alone on the shuffled-pages room, GPU 0 → `dst_device`, per setting."""
    import numpy as np

    from transfer.page_gather import gather_kernel, grid, plan

    lay = KVLayout(num_pages=1, **LAYOUTS[args.layout])  # type: ignore[arg-type]
    pages = -(-args.tokens // lay.page_size)
    src = torch.randint(0, 256, (2 * pages * lay.page_bytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src, device=dst_device)
    dst[:16].copy_(src[:16])  # torch's peer copy enables GPU 0's access to dst's GPU
    room, spans = cases(args.layout, args.tokens, src.data_ptr(), dst.data_ptr())["shuffled pages"]
    table = plan(np.array(spans, dtype=np.int64), src.data_ptr(), dst.data_ptr())
    rows = torch.from_numpy(table).to("cuda:0")
    src_w, dst_w = src.view(torch.int32), dst.view(torch.int32)
    out = []
    for chunk, block, warps in SWEEP:
        launch = functools.partial(gather_kernel[grid(table, chunk)], src_w, dst_w, rows,
                                   CHUNK=chunk, BLOCK=block, num_warps=warps)
        launch()  # compile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.repeats):
            launch()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.repeats
        out.append({"chunk_words": chunk, "block_words": block, "warps": warps,
                    "ms": round(ms, 4), "GBps": round(room / ms / 1e6, 1)})
        print(f"[page_gather] sweep GPU 0 -> {dst_device}: {out[-1]}", flush=True)
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"### cuda_ipc page gather ({r['date']}, {r['machine']})", "",
             "| placement | case | spans | kernel GB/s (room ms) | kernel back to back | "
             "per-span memcpy GB/s (room ms) | kernel / ceiling: room, back to back | verified |",
             "|---|---|---|---|---|---|---|---|"]
    for p in r["placements"]:
        ceil = p["ceiling_GBps"]
        where = f"GPU 0 → {p['dst'].replace('cuda:', 'GPU ')}, ceiling {ceil} GB/s"
        for case in ("one range", "shuffled pages", "head slices"):
            k, m = p.get(f"{case} / kernel"), p.get(f"{case} / memcpy")
            if k is None or m is None:
                continue
            lines.append(f"| {where} | {case} | {k['spans']} | {k['GBps']} ({k['room_ms']}) | "
                         f"{k['back_to_back_GBps']} | {m['GBps']} ({m['room_ms']}) | "
                         f"{k['GBps'] / ceil:.2f}, {k['back_to_back_GBps'] / ceil:.2f} | "
                         f"{k['verified'] and m['verified']} |")
    for p in r["placements"]:
        if p.get("sweep"):
            lines += ["", f"kernel alone, shuffled pages, GPU 0 → {p['dst']} (ceiling "
                          f"{p['ceiling_GBps']} GB/s): " + ", ".join(
                              f"chunk {s['chunk_words']} / block {s['block_words']} / "
                              f"{s['warps']} warps {s['GBps']} GB/s" for s in p["sweep"])]
    lines += [f"error: {e}" for e in r.get("errors", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layout", default="8b", choices=sorted(LAYOUTS))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": str(date.today()), "placements": [], "errors": [],
                              "machine": f"{torch.cuda.device_count()}x "
                                         f"{torch.cuda.get_device_name(0)}"}
    for dst in ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else []):
        try:
            result["placements"].append(placement(dst, args))
            result["placements"][-1]["sweep"] = kernel_sweep(dst, args)
        except Exception as e:  # keep the other placement's figures; the error is in the report
            result["errors"].append(f"{dst}: {type(e).__name__}: {str(e)[-2000:]}")
        (args.out / "page_gather.json").write_text(json.dumps(result, indent=1))
        (args.out / "page_gather.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()
