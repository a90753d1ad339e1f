"""The cuda_ipc gather kernel (transfer/page_gather.py) against per-span copies.

CPU: the work table (pieces, word offsets, the grid), which spans qualify, and the kernel itself
under Triton's interpreter over CPU tensors (in a subprocess with TRITON_INTERPRET=1, so the
rest of the suite keeps compiled Triton): shuffled whole pages, head slices of heterogeneous TP,
a range longer than a piece, and lengths that end inside a loop block, each equal to the byte
copy of the same spans. GPU (marker `gpu`): the backend's kernel path writes exactly what the
per-span cuMemcpyAsync path (the reference) writes, with unaligned spans and the pinned host
scratch source mixed in (those go by memcpy); on two GPUs, across NVLink into the other GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from orchestrator.launch.background import REPO

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _spans(rng: random.Random, src_base: int, dst_base: int, page: int, pages: int,
           head: int) -> list[tuple[int, int, int]]:
    """Shuffled whole pages into the first half of the pages, then head slices of the other
    source pages into the second half (heterogeneous TP's spans). No two spans write the same
    byte, as in a real room: the kernel writes spans in parallel, so overlapping writes would
    have no defined winner."""
    dst = rng.sample(range(pages // 2), pages // 2)
    out = [(src_base + i * page, dst_base + d * page, page) for i, d in enumerate(dst)]
    for i, d in zip(range(pages // 2, pages), rng.sample(range(pages // 2, pages), pages // 2),
                    strict=True):
        for h in range(0, page, 2 * head):  # every other head slice of the page
            out.append((src_base + i * page + h, dst_base + d * page + h + head, head))
    return out


def test_plan_cuts_long_ranges_into_pieces_in_words() -> None:
    from transfer.page_gather import grid, plan

    spans = np.array([(4096, 1 << 20, 48), (8192, 2 << 20, 160), (0, 0, 16)], dtype=np.int64)
    table = plan(spans, 0, 0, piece_bytes=64)
    assert table.tolist() == [
        [1024, 262144, 12],
        [2048, 524288, 16], [2064, 524304, 16], [2080, 524320, 8],  # 160 bytes = 64 + 64 + 32
        [0, 0, 4],
    ]
    assert grid(table, chunk_words=8) == (5, 2)
    assert grid(plan(spans[:0], 0, 0)) == (0, 1)  # nothing to move launches nothing
    rel = plan(spans, 4096, 1 << 20)  # offsets are from the two bases
    assert rel[0].tolist() == [0, 0, 12]


def test_only_16_byte_aligned_ranges_qualify() -> None:
    from transfer.page_gather import eligible

    spans = np.array([(16, 32, 48), (8, 32, 48), (16, 40, 48), (16, 32, 40), (16, 32, 0)],
                     dtype=np.int64)
    assert eligible(spans).tolist() == [True, False, False, False, False]


def _interpreted_check() -> None:
    """Run under TRITON_INTERPRET=1: the kernel over CPU tensors equals per-span byte copies."""
    from transfer.page_gather import eligible, gather_kernel, grid, plan

    rng = random.Random(7)
    page, pages, head = 1024, 12, 64
    src = torch.randint(0, 256, (pages * page,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    for chunk, block, piece in ((64, 16, 1 << 20), (32, 32, 256), (256, 64, 4096)):
        dst = torch.zeros(pages * page + 4096, dtype=torch.uint8)
        want = dst.clone()
        spans = _spans(rng, src.data_ptr(), dst.data_ptr(), page, pages, head)
        spans.append((src.data_ptr() + 16, dst.data_ptr() + pages * page, 2000))  # long, ragged
        arr = np.array(spans, dtype=np.int64)
        assert eligible(arr).all()
        for s, d, n in spans:  # the reference: one copy per span
            want[d - dst.data_ptr():d - dst.data_ptr() + n] = src[s - src.data_ptr():
                                                                  s - src.data_ptr() + n]
        table = plan(arr, src.data_ptr(), dst.data_ptr(), piece_bytes=piece)
        gather_kernel[grid(table, chunk)](src.view(torch.int32), dst.view(torch.int32),
                                          torch.from_numpy(table), CHUNK=chunk, BLOCK=block)
        assert torch.equal(dst, want), (chunk, block, piece)
    print("interpreted gather ok")


def test_kernel_index_math_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.transfer.test_page_gather import _interpreted_check as c; c()"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "interpreted gather ok" in out.stdout


# ---- GPU: the backend's two copy paths ---------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _land(path: object, src: torch.Tensor, dst: torch.Tensor,
          spans: list[tuple[int, int, int]], scratch: torch.Tensor) -> torch.Tensor:
    """Write `spans` src → dst through a cuda_ipc backend in this process; return dst's bytes."""
    from transfer.cuda_ipc import CudaIpcBackend

    dst.zero_()
    torch.cuda.synchronize()
    a, b = CudaIpcBackend("a", copy_path=path), CudaIpcBackend("b")  # type: ignore[arg-type]
    try:
        a.register(src.data_ptr(), src.numel())
        a.register(scratch.data_ptr(), scratch.numel())  # host source: always by memcpy
        b.register(dst.data_ptr(), dst.numel())
        a.connect(b.agent_name, b.agent_metadata)
        a.write(b.agent_name, spans, timeout_s=30)
        return dst.cpu()
    finally:
        a.close()
        b.close()


class _At:
    """A pool known only by its address (the other process's)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _mixed_spans(src: torch.Tensor, dst: torch.Tensor | _At, scratch: torch.Tensor,
                 page: int) -> list[tuple[int, int, int]]:
    pages = src.numel() // page
    spans = _spans(random.Random(3), src.data_ptr(), dst.data_ptr(), page, pages, 512)
    past = dst.data_ptr() + pages * page  # the spans below land past those of _spans
    spans.append((src.data_ptr() + 5, past + 3, 1001))  # unaligned: memcpy
    spans.append((scratch.data_ptr(), past + page + 100, 64))  # from host memory
    spans.append((src.data_ptr(), past + 2 * page, 9 << 20))  # longer than one piece
    return spans


def _long_span_at(src: torch.Tensor, page: int) -> int:
    """Where _mixed_spans's long span lands in the destination (its first bytes)."""
    return (src.numel() // page + 2) * page


@pytest.mark.gpu
@gpu
def test_kernel_path_writes_what_the_per_span_path_writes() -> None:
    from transfer.cuda_ipc import CopyPath

    page = 64 << 10
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    scratch = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    spans = _mixed_spans(src, dst, scratch, page)
    want = _land(CopyPath.MEMCPY, src, dst, spans, scratch)
    got = _land(CopyPath.KERNEL, src, dst, spans, scratch)
    assert torch.equal(got, want)
    at = _long_span_at(src, page)
    assert int(want[at:at + 4096].count_nonzero()) > 0, "the spans wrote something"


def _serve_pool(device: str, nbytes: int, cmds: mp.Queue, out: mp.Queue) -> None:
    """Child: a zeroed pool on `device`, exported; ("dump",) sends its bytes, ("zero",) clears."""
    from transfer.cuda_ipc import CudaIpcBackend

    pool = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    backend = CudaIpcBackend("decode-child")
    backend.register(pool.data_ptr(), pool.numel())
    out.put((backend.agent_name, backend.agent_metadata, pool.data_ptr()))
    try:
        while (cmd := cmds.get(timeout=120)) != "stop":
            if cmd == "zero":
                pool.zero_()
            torch.cuda.synchronize()
            out.put(bytes(pool.cpu().numpy()) if cmd == "dump" else "ok")
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_writes_across_nvlink_into_another_process_gpu() -> None:
    """Prefill's pool on GPU 0, decode's on GPU 1 in another process (the 1P1D placement)."""
    from transfer.cuda_ipc import CopyPath, CudaIpcBackend

    page, nbytes = 64 << 10, 40 << 20
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_serve_pool, args=("cuda:1", nbytes, cmds, out), daemon=True)
    proc.start()
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device="cuda:0")
    scratch = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    try:
        name, meta, ptr = out.get(timeout=120)
        landed = []
        for path in (CopyPath.MEMCPY, CopyPath.KERNEL):
            cmds.put("zero")
            assert out.get(timeout=30) == "ok"
            backend = CudaIpcBackend("prefill", copy_path=path)
            try:
                backend.register(src.data_ptr(), src.numel())
                backend.register(scratch.data_ptr(), scratch.numel())
                backend.connect(name, meta)
                backend.write(name, _mixed_spans(src, _At(ptr), scratch, page), timeout_s=30)
            finally:
                backend.close()
            cmds.put("dump")
            landed.append(out.get(timeout=60))
        assert landed[0] == landed[1]
        at = _long_span_at(src, page)
        assert landed[0][at:at + 4096] != bytes(4096)
        cmds.put("stop")
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
