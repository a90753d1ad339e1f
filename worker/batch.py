"""What one forward pass needs to know about the batch (built by the runner from a plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MixedRows:
    """The attention rows of a captured mixed step (worker/mixed_graphs.py): device tensors of
    fixed shape per token bucket, so the step's attention reads no host value. D one-token
    rows, R multi-token requests; padding decode rows have context 0 and write into row T (a
    spare row past the bucket), padding requests have no rows (start = end)."""

    decode_q_rows: torch.Tensor  # [D] int64: each one-token request's row in q (padding: 0)
    decode_out_rows: torch.Tensor  # [D] int64: its row in the output (padding: T)
    decode_seq_lens: torch.Tensor  # [D] int64: context after this step (padding: 0)
    decode_page_table: torch.Tensor  # [D, max_pages] int64
    prefill_start: torch.Tensor  # [R] int64: each multi-token request's first row in q
    prefill_end: torch.Tensor  # [R] int64: one past its last row
    prefill_seq_lens: torch.Tensor  # [R] int64: context after this step
    prefill_page_table: torch.Tensor  # [R, max_pages] int64


@dataclass
class ForwardBatch:
    """Flattened tokens of every request scheduled this step, and where their KV lives.

    Requests are laid out one after another: request i owns tokens
    `query_start[i]:query_start[i+1]` of `input_ids`.
    """

    input_ids: torch.Tensor  # [T] int64: new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] int64: absolute position of each new token in its sequence
    query_start: torch.Tensor  # [B+1] int64: offsets of each request's tokens in input_ids
    seq_lens: torch.Tensor  # [B] int64: context length after this step (cached + new tokens)
    page_table: torch.Tensor  # [B, max_pages] int64: each request's pages, padded with 0
    # [T] int64: page * page_size + offset where each new token's KV goes
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor  # [B] int64: index in input_ids of each request's last new token

    # Host copies, so CPU attention can loop without device syncs.
    query_start_list: list[int]
    seq_lens_list: list[int]

    # Window layers (models whose window layers keep a ring of pages, see docs/hybrid-cache.md);
    # None when every layer reads full pages.
    # [T] ring page * page_size + offset; -1 = not kept
    window_slot_mapping: torch.Tensor | None = None
    # [C] ring slots of each request's window history
    window_context_slots: torch.Tensor | None = None
    # [B+1] host offsets of each request's history in window_context_slots: request i attends to
    # the history (the tokens just before its chunk that its window reaches) plus its new tokens.
    window_context_start: list[int] | None = None

    # Recurrent layers (Qwen3-Next's Gated DeltaNet, see docs/recurrent-state.md); None when the
    # model has none. [B] int64: request i's state slot in KVCache.state. The contract: when
    # request i's chunk starts at position p, the slot holds the state after tokens [0, p)
    # (zeros at p = 0: the cache manager zeroes or restores it before the step); the model
    # reads it and leaves the state after the chunk in the same slot.
    state_slots: torch.Tensor | None = None
    # Speculative verify steps over recurrent layers: the requests whose chunk holds drafts;
    # their layers keep the state after each token, for CausalLM.commit_verified.
    verify_requests: list[int] | None = None

    # > 0: every request has exactly this many new tokens and the device tensors are all that
    # may be read (a CUDA-graph verify step, worker/cuda_graphs.py `VerifyGraphs`): the CUDA
    # backend then runs one paged kernel over them instead of a per-request loop. The host
    # lists above are placeholders then. 0 = a step built by the runner.
    uniform_query_len: int = 0
    # Set: a captured mixed step (worker/mixed_graphs.py); the CUDA backend reads only these
    # and slot_mapping, and the request fields above are placeholders.
    mixed_rows: MixedRows | None = None
    # [B] each request's num_prompt_tokens (host): dynamic NTK RoPE rotates every prompt token
    # with the whole prompt's length, as transformers' one-pass prefill does, whatever the
    # chunking (worker/model/rope.py). None (steps not built by the runner): the step's lengths.
    prompt_lens_list: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
