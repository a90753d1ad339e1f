"""One kernel moves a batch of scattered KV ranges: a room's pages (or head slices) in one launch.

Why: one cuMemcpyAsync per page costs ~6 µs of host time per call and runs on a copy engine. A
3072-token room of an 8B model (192 pages of 2.36 MB) moved page by page in shuffled order at
380 GB/s, against 1,585 GB/s as one range and ~2,080 GB/s that the device's copy moves
(docs/gpu.md). Here one Triton program per (range piece, 64 KiB chunk) copies with 16-byte
vector loads and stores, so a room moves at the SM copy rate whatever its page order; across
GPUs the stores go over NVLink into the peer's pool, mapped here through its IPC handle.

The work table: ranges are cut into pieces of at most PIECE_BYTES (so grid axis 1 stays short
however long one range is), one row per piece `[src word, dst word, words]`, offsets in 4-byte
words from two 16-byte-aligned base pointers; program (i, j) copies words
`[j*CHUNK, min((j+1)*CHUNK, n_i))` of piece i. A range qualifies only when both addresses and
its length are multiples of 16 bytes (KV pages and head slices are; `eligible` says which);
the backend copies the others with cuMemcpyAsync.

torch and triton are imported by this module only, and the backend imports it only when it
registers a GPU pool (a worker on a GPU holds both already): transfer.cuda_ipc itself stays
importable without either.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

WORD = 4  # bytes per element the kernel moves (int32; four of them make one 16-byte vector)
ALIGN = 16  # both addresses and the length of a range the kernel takes
PIECE_BYTES = 4 << 20  # longer ranges are cut: grid axis 1 <= PIECE_BYTES / (CHUNK_WORDS * WORD)
CHUNK_WORDS = 16384  # 64 KiB per program
BLOCK_WORDS = 2048  # 8 KiB per loop step: 16 words = four 16-byte vectors per thread at 4 warps
NUM_WARPS = 4


@triton.jit
def gather_kernel(src, dst, table, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, j): words [j*CHUNK, min((j+1)*CHUNK, n)) of table row i = (s, d, n)."""
    row = tl.program_id(0).to(tl.int64) * 3
    s = tl.multiple_of(tl.load(table + row), 4)  # every offset is a whole 16 bytes
    d = tl.multiple_of(tl.load(table + row + 1), 4)
    n = tl.multiple_of(tl.load(table + row + 2), 4)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    end = tl.multiple_of(tl.minimum(start + CHUNK, n), 4)
    full = start + (end - start) // BLOCK * BLOCK
    # Whole blocks unmasked: nothing stops 16-byte vectors (a mask whose alignment the compiler
    # cannot prove would split them into 4-byte accesses).
    for off in range(start, full, BLOCK):
        idx = off + tl.arange(0, BLOCK)  # [BLOCK] word offsets inside the piece
        tl.store(dst + d + idx, tl.load(src + s + idx))
    if full < end:  # the tail: under one block, a whole number of 16-byte vectors
        idx = full + tl.arange(0, BLOCK)
        mask = idx < end
        tl.store(dst + d + idx, tl.load(src + s + idx, mask=mask), mask=mask)


def eligible(spans: np.ndarray) -> np.ndarray:
    """[N, 3] int64 (src address, dst address, bytes) → [N] bool: the ranges the kernel takes."""
    return ((spans[:, 0] | spans[:, 1] | spans[:, 2]) % ALIGN == 0) & (spans[:, 2] > 0)


def plan(spans: np.ndarray, src_base: int, dst_base: int,
         piece_bytes: int = PIECE_BYTES) -> np.ndarray:
    """Eligible ranges [N, 3] (addresses, bytes) → the work table [P, 3] int64 in words from the
    two bases (each a multiple of ALIGN), ranges cut into pieces of at most `piece_bytes`."""
    assert src_base % ALIGN == 0 and dst_base % ALIGN == 0 and piece_bytes % ALIGN == 0
    n = spans[:, 2]
    count = -(-n // piece_bytes)  # [N] pieces per range
    which = np.repeat(np.arange(len(n)), count)  # [P] the range each piece is cut from
    first = np.cumsum(count) - count
    off = (np.arange(which.size) - np.repeat(first, count)) * piece_bytes  # [P] bytes into it
    table = np.empty((which.size, 3), dtype=np.int64)
    table[:, 0] = (spans[which, 0] - src_base + off) // WORD
    table[:, 1] = (spans[which, 1] - dst_base + off) // WORD
    table[:, 2] = np.minimum(piece_bytes, n[which] - off) // WORD
    return table


def grid(table: np.ndarray, chunk_words: int = CHUNK_WORDS) -> tuple[int, int]:
    """(pieces, chunks of the longest piece): the launch grid of `table`."""
    if not table.shape[0]:
        return 0, 1
    return int(table.shape[0]), -(-int(table[:, 2].max()) // chunk_words)


class DevicePointer:
    """A raw device address the way Triton takes a pointer argument (`data_ptr()` + `dtype`):
    the peer's pool, mapped through its IPC handle, has no torch tensor."""

    dtype = torch.int32

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class PageGather:
    """Launches `gather_kernel` on the backend's copy stream (a driver-API stream handle)."""

    def __init__(self, ordinal: int, stream: int) -> None:
        self.device = torch.device("cuda", ordinal)
        self._stream = torch.cuda.ExternalStream(stream, device=self.device)
        # Compile now (an empty grid launches nothing), not when the first room is waiting.
        self.launch(0, 0, np.zeros((0, 3), dtype=np.int64))

    def launch(self, src_base: int, dst_base: int,
               spans: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the copy of eligible `spans` (absolute addresses) behind what the stream holds.
        Returns the work table's host and device copies: keep them until the stream passed."""
        src_base, dst_base = src_base - src_base % ALIGN, dst_base - dst_base % ALIGN
        table = plan(spans, src_base, dst_base)
        host = torch.from_numpy(table if table.size else np.zeros((1, 3), np.int64)).pin_memory()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            rows = host.to(self.device, non_blocking=True)  # [P, 3] int64
            gather_kernel[grid(table)](DevicePointer(src_base), DevicePointer(dst_base), rows,
                                       CHUNK=CHUNK_WORDS, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)
        return host, rows
