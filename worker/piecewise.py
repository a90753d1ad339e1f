"""Piecewise CUDA graphs for steps that carry prefill chunks: graphs around attention.

Why: a pure-decode step replays one CUDA graph (worker/cuda_graphs.py), but a step that also
carries prefill chunks used to run eager: ~15 launches per layer from Python, so the decode rows
riding in it paid an eager step's CPU time — mono's inter-token p99 at ten times its p50 under
steady load. Attention is the only part of a dense layer whose launch depends on the batch's
shape (how many requests, how long each context); everything else (embedding, RoPE, norms, the
projections and the MLP) only depends on the number of tokens. So those parts are captured as
graphs per padded token count and attention runs eagerly between them.

How:
1. `PiecewiseGraphs(model, kv, max_tokens)` puts an `_AttentionSeam` in front of the model's
   attention backend (every layer shares it). Outside capture and replay the seam just calls the
   real backend, so every other path is unchanged.
2. `capture()`: for each token bucket (16, 32, ... max_tokens), largest first, one forward runs
   on a side stream inside manual `capture_begin` / `capture_end` calls: each time a layer calls
   attention, the seam copies q, k, v into shared static buffers, ends the current graph and
   begins the next, and returns the shared output buffer. A bucket is n_layers + 1 graphs
   ("pieces") that share one memory pool; static token inputs are padding (slot -1: the fused
   K/V store inside a piece writes nothing).
3. `run(batch)`: copy the step's ids, positions and slots into the static inputs (padding:
   slot -1), replay piece 0, then per layer run the real backend on the first T rows of the
   static q, k, v with the step's real batch (page tables, context lengths: eager), write its
   output into the static output and replay the next piece. Returns the hidden states [T, H].

Only for dense models whose layers have no state outside attention (`supports_piecewise`):
window rings, recurrent state and MoE dispatch read the batch inside a piece.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.batch import ForwardBatch
from worker.kv_cache import KVCache
from worker.model import CausalLM
from worker.model.attention import AttentionBackend, KVScales

log = logging.getLogger(__name__)

MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: powers of two from MIN_BUCKET, then max_tokens itself."""
    sizes, b = [], MIN_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return [*sizes, max_tokens]


@dataclass
class _Call:
    """One attention call of a captured bucket: what the real backend gets at replay."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    kv_stored: bool
    sinks: torch.Tensor | None
    kv_scales: KVScales


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # n_layers + 1
    calls: list[_Call] = field(default_factory=list)  # n_layers
    hidden: torch.Tensor | None = None  # [bucket, H] the last piece's output (static)


class _AttentionSeam(AttentionBackend):
    """In front of the real backend: pass-through, or the seam between two captured pieces."""

    def __init__(self, real: AttentionBackend, owner: PiecewiseGraphs) -> None:
        self.real = real
        self._owner = owner

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, batch: ForwardBatch, scale: float,
        sliding_window: int | None = None, kv_stored: bool = False,
        sinks: torch.Tensor | None = None, kv_scales: KVScales = None,
    ) -> torch.Tensor:
        owner = self._owner
        if owner.capturing is None:
            return self.real.forward(q, k, v, k_cache, v_cache, batch, scale, sliding_window,
                                     kv_stored, sinks, kv_scales)
        return owner.seam(q, k, v, _Call(k_cache, v_cache, scale, sliding_window, kv_stored,
                                         sinks, kv_scales))


class PiecewiseGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, max_tokens: int) -> None:
        self.model = model
        self.kv = kv
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        device = kv.data.device
        t = self.max_tokens
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)  # [Tmax]
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)  # [Tmax]
        self.slots = torch.full((t,), -1, dtype=torch.int64, device=device)  # [Tmax]
        self._qkv: dict[str, torch.Tensor] = {}  # q/k/v/o [Tmax, heads, D], made at capture
        self._graphs: dict[int, _Bucket] = {}
        self.capturing: _Bucket | None = None
        self._warming = False  # the eager runs before capture: pieces are _NoGraph
        self._pool: Any = None
        self.num_replays = 0
        seam: _AttentionSeam | None = None
        for module in model.modules():  # every attention layer holds the shared backend
            real = getattr(module, "backend", None)
            if isinstance(real, AttentionBackend) and not isinstance(real, _AttentionSeam):
                if seam is None or seam.real is not real:
                    seam = _AttentionSeam(real, self)
                module.backend = seam  # type: ignore[assignment]
        assert seam is not None, "the model has no attention backend to put a seam in front of"
        self._real = seam.real  # what replay calls between the pieces

    # ---- capture ---------------------------------------------------------------------------

    def _static_batch(self, bs: int) -> ForwardBatch:
        """Token inputs of one bucket; the request fields are placeholders (no piece reads them)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            query_start=self.positions.new_tensor([0, bs]),
            seq_lens=self.positions.new_tensor([bs]),
            page_table=self.positions.new_zeros(1, 1), slot_mapping=self.slots[:bs],
            logits_indices=self.positions.new_zeros(0), query_start_list=[0, bs],
            seq_lens_list=[bs])

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._qkv.get(name)
        if buf is None:  # allocated outside any capture, at the largest bucket's first call
            buf = self._qkv[name] = torch.zeros((self.max_tokens, *like.shape[1:]),
                                                dtype=like.dtype, device=like.device)
        return buf

    def seam(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> torch.Tensor:
        """A layer's attention during capture: end this piece, begin the next."""
        bucket = self.capturing
        assert bucket is not None
        n = q.shape[0]
        for name, x in (("q", q), ("k", k), ("v", v)):
            self._buffer(name, x)[:n].copy_(x)  # inside the piece: replay refreshes them
        out = self._buffer("o", q)[:n]  # [n, Hq, D] written by the real backend at replay
        bucket.pieces[-1].capture_end()
        bucket.calls.append(call)
        nxt: Any = _NoGraph() if self._warming else torch.cuda.CUDAGraph()
        bucket.pieces.append(nxt)
        nxt.capture_begin(pool=self._pool)
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket eagerly (Triton compiles), then capture, largest first."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._warming = True
            try:
                for bs in reversed(self.buckets):
                    for _ in range(2):
                        self.capturing = _Bucket(pieces=[_NoGraph()])  # type: ignore[list-item]
                        self.model(self._static_batch(bs), self.kv)
            finally:
                self.capturing, self._warming = None, False
            torch.cuda.synchronize()
            for bs in reversed(self.buckets):
                batch = self._static_batch(bs)  # before the capture: it copies host lists
                bucket = _Bucket(pieces=[torch.cuda.CUDAGraph()])
                self.capturing = bucket
                try:
                    bucket.pieces[0].capture_begin(pool=self._pool)
                    bucket.hidden = self.model(batch, self.kv)  # [bs, H]
                    bucket.pieces[-1].capture_end()
                except BaseException:
                    _end_failed_capture(bucket.pieces[-1])
                    raise
                finally:
                    self.capturing = None
                self._graphs[bs] = bucket
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    # ---- replay ----------------------------------------------------------------------------

    def bucket_for(self, num_tokens: int) -> int | None:
        for bs in self.buckets:
            if bs >= num_tokens:
                return bs if bs in self._graphs else None
        return None

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's hidden states [T, H] for `batch` (T <= max_tokens): pieces replayed,
        attention eager over the real batch. Valid until the next run."""
        t = batch.num_tokens
        bs = self.bucket_for(t)
        assert bs is not None, f"no piecewise graphs for {t} tokens"
        bucket = self._graphs[bs]
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slots[:t].copy_(batch.slot_mapping)
        self.slots[t:bs].fill_(-1)  # padding rows store nothing
        q, k, v, o = (self._qkv[n] for n in ("q", "k", "v", "o"))
        real = self._real
        bucket.pieces[0].replay()
        for call, piece in zip(bucket.calls, bucket.pieces[1:], strict=True):
            o[:t].copy_(real.forward(q[:t], k[:t], v[:t], call.k_cache, call.v_cache, batch,
                                     call.scale, call.sliding_window, call.kv_stored, call.sinks,
                                     call.kv_scales))
            piece.replay()
        self.num_replays += 1
        assert bucket.hidden is not None
        return bucket.hidden[:t]


def _end_failed_capture(graph: torch.cuda.CUDAGraph) -> None:
    """A capture that raised leaves its stream capturing, which fails every later CUDA call in
    the process: end it. Ending an invalidated capture raises too; the first error is the one
    worth reporting, so that second one is only logged."""
    try:
        graph.capture_end()
    except RuntimeError as exc:
        log.debug("ending a failed piecewise capture: %s", exc)


class _NoGraph:
    """Stands in for a CUDAGraph during the eager warm-up runs (the seam calls these)."""

    def capture_begin(self, pool: Any = None) -> None:
        pass

    def capture_end(self) -> None:
        pass
