"""Building blocks of the dense decoder: norms, tensor-parallel-ready linears, embeddings.

Weight loading is owned by the layers, not by the loader: each layer knows which slice of a
checkpoint tensor belongs to its rank. A checkpoint tensor arrives as a `TensorSource`
(worker/model/weights.py), which reads lazily (safetensors `get_slice`), so a tensor-parallel
rank reads only its rows or columns. Fused projections (q|k|v, gate|up) take one checkpoint
tensor per `shard_id`; fusing them makes one matmul instead of three (or two), which matters
on CPU.

Tensor parallelism: column-parallel layers split the output features across ranks,
row-parallel layers split the input features and all-reduce their output; the embedding and
the LM head split the vocabulary (a masked lookup + all-reduce in, an all-gather of logit
shards out). With tp_size 1 the slices are the whole tensors and no collective runs.

Block-scaled FP8 weights (`quant`: worker/model/fp8.py): a linear built with a BlockFp8Config
keeps its weight in float8_e4m3fn with `weight_scale_inv` [out rows / block_n, in / block_k]
float32 and runs worker/model/fp8_gemm.py (CUDA). Tensor parallelism slices whole scale blocks,
so every fused piece's rows on a rank (column-parallel; the last one may end short where one
rank holds it whole) or the rank's input columns (row-parallel) must be a multiple of the
block; a linear where they are not is built unquantized instead and its FP8 checkpoint tensor
dequantized at load (as on the CPU, where the loader builds every linear unquantized).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.arch.fp8_config import BlockFp8Config
from worker.model import fp8_gemm, fp8_splitk, fused, gemv
from worker.model.fp8 import FP8, BlockFp8Source
from worker.model.fp8_act import Fp8Rows
from worker.model.weights import (
    TensorSource,
    WeightShapeError,
    check_extent,
    copy_checked,
    empty_param,
)


@dataclass(frozen=True)
class TPInfo:
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None  # None = the default group (when size > 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_params(
    module: ColumnParallelLinear | RowParallelLinear,
    rows: int,
    cols: int,
    scale_rows: int,
    quant: BlockFp8Config,
) -> None:
    """An FP8 weight [rows, cols], its block scales [scale_rows, cols / block_k] and the split-K
    GEMM's tile counters on `module`."""
    module.weight = empty_param(rows, cols, dtype=FP8)
    module.weight_scale_inv = empty_param(
        scale_rows, _cdiv(cols, quant.block_k), dtype=torch.float32
    )
    module.splitk = fp8_splitk.SplitCounters()


def _fp8_source(source: TensorSource, name: str) -> BlockFp8Source:
    if not isinstance(source, BlockFp8Source):
        raise WeightShapeError(
            f"{name}: the layer is FP8 (config.json quantization_config) but "
            "its checkpoint "
            "tensor has no weight_scale_inv; list the module in "
            "modules_to_not_convert"
        )
    return source


def gemv_scales(linear: nn.Module) -> dict[str, Any]:
    """The GEMV's FP8 arguments for a linear: its block scales, or nothing when unquantized."""
    quant = getattr(linear, "quant", None)
    if quant is None:
        return {}
    return {"w_scale": linear.weight_scale_inv, "block": (quant.block_n, quant.block_k)}


class RMSNorm(nn.Module):
    """RMSNorm in float32, weight applied in the model dtype (as transformers does).

    `add_norm(x, residual)` is the pre-norm decoder's residual step: it returns
    (norm(residual + x), residual + x). With `fused` set (CUDA) both forms are one Triton
    kernel (worker/model/fused.py); the torch code below is the reference and the CPU path.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)
        self.fused = False  # set by the model's set_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        if self.fused:
            return fused.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def norm_for(
        self, linear: ColumnParallelLinear | None, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """The pre-norm step before `linear` (None: before anything else, e.g. a MoE block's
        router): add_norm(x, residual), or (norm(x), x) where there is no residual yet (the
        first layer). Fused, with an FP8 linear that would quantize the normed rows for cuBLAS
        (fp8_gemm.input_rows), the kernel writes them quantized."""
        into = (linear.input_rows(x.shape[0], x.dtype, x.device)
                if self.fused and linear is not None else None)
        if into is not None:
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps, into=into), x
            return fused.add_rms_norm(x, residual, self.weight, self.eps, into=into)
        return (self(x), x) if residual is None else self.add_norm(x, residual)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [..., dim] → (norm(residual + x), residual + x): the sum is the new residual.
        """
        if self.fused:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self.forward(residual), residual

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        copy_checked(getattr(self, param).data, source.read(), f"RMSNorm.{param}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's rows (output features) split across TP ranks.

    `output_sizes` lists the fused pieces (one per shard_id, in order); each piece is split
    across ranks separately so every rank holds its own rows of every piece.
    """

    weight: nn.Parameter
    weight_scale_inv: nn.Parameter  # FP8 only: [rows / block_n, in / block_k] float32
    splitk: fp8_splitk.SplitCounters  # FP8 only: the split-K GEMM's tile counters

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPInfo,
        dtype: torch.dtype | None = None,
        quant: BlockFp8Config | None = None,
    ) -> None:
        super().__init__()
        for size in output_sizes:
            if size % tp.size:
                raise WeightShapeError(f"output size {size} is not divisible by tp_size {tp.size}")
        self.tp = tp
        self.local_sizes = [s // tp.size for s in output_sizes]
        self.full_sizes = list(output_sizes)  # each piece's rows in the checkpoint
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        out_local = sum(self.local_sizes)
        # FP8 only where the pieces' rows on this rank are whole scale blocks (module doc); the
        # last may end short when one rank holds it whole (MLA's q_a | kv_a: 1536 | 576 rows).
        n = quant.block_n if quant is not None else 1
        aligned = all(s % n == 0 for s in self.local_sizes[:-1])
        self.quant = quant if aligned and (tp.size == 1 or self.local_sizes[-1] % n == 0) else None
        if self.quant is not None:
            scale_rows = sum(_cdiv(s, self.quant.block_n) for s in self.local_sizes)
            # [out_local, in] e4m3
            _fp8_params(self, out_local, in_features, scale_rows, self.quant)
        else:
            self.weight = empty_param(out_local, in_features, dtype=dtype)  # [out_local, in]
        self.bias = empty_param(out_local, dtype=dtype) if bias else None  # [out_local]

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [T, in] → [T, out_local]
        if self.quant is not None:
            return fp8_gemm.fp8_linear(
                x, self.weight, self.weight_scale_inv, self.bias, self.quant, self.splitk
            )
        assert isinstance(x, torch.Tensor)  # Fp8Rows come only from input_rows (FP8 linears)
        return F.linear(x, self.weight, self.bias)

    def input_rows(self, m: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows | None:
        """Buffers for an input [m, in] quantized as this linear would quantize it itself, when
        it would (fp8_gemm.input_rows), for the kernel before it to fill; else None."""
        return _input_rows(self.quant, self.weight, m, dtype, device)

    def _shard_index(self, shard_id: object) -> int:
        return 0 if shard_id is None else int(shard_id)  # type: ignore[call-overload]

    def _rank_start(self, i: int) -> int:
        """Where this rank's rows of piece i start in the checkpoint tensor."""
        return self.tp.rank * self.local_sizes[i]

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        i = self._shard_index(shard_id)
        local = self.local_sizes[i]
        start = self._rank_start(i)
        name = f"{type(self).__name__}.{param}[{shard_id}]"
        check_extent(source, 0, self.full_sizes[i], name)
        # FP8 rows and their scale rows, as they are
        if self.quant is not None and param == "weight":
            w, s = _fp8_source(source, name).read_quantized(0, start, start + local)
            copy_checked(self.weight.data.narrow(0, self.offsets[i], local), w, name)
            scales = self.weight_scale_inv.data.narrow(
                0, self.offsets[i] // self.quant.block_n, s.shape[0]
            )
            copy_checked(scales, s, name + ".weight_scale_inv")
            return
        dst = getattr(self, param).data.narrow(0, self.offsets[i], local)
        copy_checked(dst, source.read(0, start, start + local), name)


def _input_rows(
    quant: BlockFp8Config | None, weight: torch.Tensor, m: int, dtype: torch.dtype,
    device: torch.device,
) -> Fp8Rows | None:
    """A linear's FP8 input buffers for m rows (fp8_gemm.input_rows); None if it is not FP8. The
    linears hand their split-K counters to fp8_linear, so the split-K route counts."""
    if quant is None:
        return None
    n, k = weight.shape
    return fp8_gemm.input_rows(m, k, n, dtype, device, quant, splitk=True)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: an even split, or one replicated head when tp_size > num_kv_heads.
    """
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise WeightShapeError(
                f"num_kv_heads ({num_kv_heads}) must be divisible by tp_size ({tp_size})"
            )
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise WeightShapeError(
            f"tp_size ({tp_size}) > num_kv_heads ({num_kv_heads}) needs tp_size to be a multiple "
            "of num_kv_heads (each kv head is then replicated on tp_size / num_kv_heads ranks)"
        )
    return 1


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: shard_id is "q", "k" or "v"; heads split across ranks.

    With more ranks than kv heads (GQA), ranks [h*rep, (h+1)*rep) each hold a replica of kv
    head h — the same placement as `transfer.contract.heads_of_rank`, so KV pages line up.
    """

    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPInfo,
        dtype: torch.dtype | None = None,
        quant: BlockFp8Config | None = None,
    ) -> None:
        if num_heads % tp.size:
            raise WeightShapeError(
                f"num_heads ({num_heads}) must be divisible by tp_size ({tp.size})"
            )
        kv_local = kv_heads_per_rank(num_kv_heads, tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)  # ranks sharing one kv head
        kv_shard = kv_local * head_dim * tp.size  # the size the base class splits evenly
        super().__init__(hidden, [num_heads * head_dim, kv_shard, kv_shard], bias, tp, dtype, quant)
        self.full_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2  # replicas: once

    def _shard_index(self, shard_id: object) -> int:
        return self.SHARDS.index(str(shard_id))

    def _rank_start(self, i: int) -> int:
        if i == 0 or self.kv_replicas == 1:
            return super()._rank_start(i)
        return (self.tp.rank // self.kv_replicas) * self.local_sizes[
            i
        ]  # the replicated head's rows


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's columns (input features) split across ranks; output all-reduced."""

    weight: nn.Parameter
    weight_scale_inv: nn.Parameter  # FP8 only: [out / block_n, in_local / block_k] float32
    splitk: fp8_splitk.SplitCounters  # FP8 only: the split-K GEMM's tile counters

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPInfo,
        dtype: torch.dtype | None = None,
        quant: BlockFp8Config | None = None,
    ) -> None:
        super().__init__()
        if in_features % tp.size:
            raise WeightShapeError(
                f"input size {in_features} is not divisible by tp_size {tp.size}"
            )
        self.tp = tp
        self.in_local = in_features // tp.size
        # FP8 only where this rank's input columns are whole scale blocks (see module doc).
        aligned = quant is not None and self.in_local % quant.block_k == 0
        self.quant = quant if quant and (tp.size == 1 or aligned) else None
        if self.quant is not None:
            _fp8_params(
                self,
                out_features,
                self.in_local,
                _cdiv(out_features, self.quant.block_n),
                self.quant,
            )
        else:
            self.weight = empty_param(out_features, self.in_local, dtype=dtype)  # [out, in_local]
        self.bias = (
            empty_param(out_features, dtype=dtype) if bias else None
        )  # added once, after the reduce

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:  # [T, in_local] → [T, out]
        if self.quant is not None:
            y = fp8_gemm.fp8_linear(
                x, self.weight, self.weight_scale_inv, None, self.quant, self.splitk
            )
        else:
            assert isinstance(x, torch.Tensor)  # Fp8Rows come only from input_rows (FP8 linears)
            y = F.linear(x, self.weight)
        if self.tp.size > 1:
            dist.all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias

    def input_rows(self, m: int, dtype: torch.dtype, device: torch.device) -> Fp8Rows | None:
        """As ColumnParallelLinear.input_rows, for an input [m, in_local]."""
        return _input_rows(self.quant, self.weight, m, dtype, device)

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        if param == "bias":
            copy_checked(self.bias.data, source.read(), "RowParallelLinear.bias")  # type: ignore[union-attr]
            return
        start = self.tp.rank * self.in_local
        check_extent(source, 1, self.in_local * self.tp.size, "RowParallelLinear.weight")
        if self.quant is not None:  # FP8 columns and their scale columns, as they are
            w, s = _fp8_source(source, "RowParallelLinear.weight").read_quantized(
                1, start, start + self.in_local
            )
            copy_checked(self.weight.data, w, "RowParallelLinear.weight")
            copy_checked(self.weight_scale_inv.data, s, "RowParallelLinear.weight_scale_inv")
            return
        copy_checked(
            self.weight.data,
            source.read(1, start, start + self.in_local),
            "RowParallelLinear.weight",
        )


def vocab_shard(vocab_size: int, tp: TPInfo) -> tuple[int, int, int]:
    """(start, stop, padded shard size) of this rank's vocabulary rows; the last shard may be short.
    """
    per = -(-vocab_size // tp.size)  # ceil: every rank holds the same padded shape
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


class Embedding(nn.Module):
    """Vocab-parallel token embedding: each rank holds rows [start, stop) of the vocabulary.

    A rank looks up the ids it holds, zeroes the others, and one all-reduce sums the shards
    (exactly one rank contributes each row, so the sum is exact).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        dtype: torch.dtype | None = None,
        tp: TPInfo | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TPInfo()
        self.vocab_size = vocab_size
        self.start, self.stop, per = vocab_shard(vocab_size, self.tp)
        self.weight = empty_param(per, hidden, dtype=dtype)  # [V_local (padded), hidden]
        self.fused = False  # one row's logits through gemv (set by the model's set_fused_kernels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] → [T, hidden]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.stop)  # [T]
        local = torch.where(outside, 0, ids - self.start)
        x = F.embedding(local, self.weight)
        x = x.masked_fill(outside[:, None], 0)  # [T, hidden]
        dist.all_reduce(x, group=self.tp.group)
        return x

    def load(self, param: str, source: TensorSource, shard_id: object = None) -> None:
        n = self.stop - self.start
        check_extent(source, 0, self.vocab_size, f"{type(self).__name__}.weight")
        rows = source.read(0, self.start, self.stop)
        copy_checked(self.weight.data[:n], rows, f"{type(self).__name__}.weight")
        self.weight.data[n:].zero_()  # padding rows: their logits are sliced off

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] @ this matrix^T → full logits [N, V] float32 (gathers shards)."""
        if self.fused and self.tp.size == 1 and hidden.shape[0] == 1:
            return gemv.gemv(
                hidden,
                self.weight,
                out=hidden.new_empty(1, self.weight.shape[0], dtype=torch.float32),
            )
        local = F.linear(hidden, self.weight).float()  # [N, V_local]
        if self.tp.size == 1:
            return local
        shards = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(shards, local, group=self.tp.group)
        return torch.cat(shards, dim=-1)[:, : self.vocab_size]  # [N, V]


class LMHead(Embedding):
    """Output projection [V, hidden], vocab-parallel like the embedding; logits in float32."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] → [N, V]
        return self.logits(hidden)
