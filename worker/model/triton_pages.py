"""Reading V from token-major pages in the Triton attention kernels (decode and prefill).

FP8 pages keep V token-major: a head's block of a page is [head_dim, page_size] in memory
(worker/kv_cache.py; `attention.v_token_major` tells the layouts apart). `load_v_token_major`
reads BLOCK_N tokens of one head from such pages as [BLOCK_N, D]: one 16-byte run per (page,
feature), which Triton keeps as the P·V dot's operand without converting e4m3 rows through
shared memory. It reads whole pages, so a caller masks tokens through P (zero weight), never
through V: a stored value is always finite (the stores saturate and write no NaN), and 0 times
a finite value is 0. The kernels take it as a constexpr argument (`LOAD_V`); this module
imports triton, so import it only where a kernel launches.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_v_token_major(
    vc_ptr, pt_row, n0, end, stride_vp, head_off,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """V of tokens n0 .. n0 + BLOCK_N (n0 a multiple of PAGE) of the head at `head_off`,
    through the page-table row `pt_row`: [BLOCK_N, D]; pages from `end` on read as 0."""
    pi = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)  # [BN/PAGE] page slots of the row
    live = pi * PAGE < end
    page = tl.load(pt_row + pi, mask=live, other=0).to(tl.int64)
    o = tl.arange(0, PAGE)
    d = tl.arange(0, D)
    v = tl.load(
        vc_ptr + page[:, None, None] * stride_vp + head_off + o[None, :, None]
        + d[None, None, :] * PAGE,
        mask=live[:, None, None], other=0.0,
    )  # [BN/PAGE, PAGE, D]
    return tl.reshape(v, [BLOCK_N, D])
