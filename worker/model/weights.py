"""Checkpoint tensors as the layers read them, and the checks of their shapes.

A checkpoint tensor reaches a layer's `load` as a `TensorSource`, which reads lazily
(safetensors `get_slice`, worker/model/loader.py), so a tensor-parallel rank reads only its rows
or columns. A layer checks what it reads: the slice against its parameter (`copy_checked`) and,
because a slice cannot tell a wider tensor from the right one, the whole tensor's extent along
the split dimension (`check_extent`). A mismatch is a `WeightShapeError`, a `ModelLoadError`:
the worker refuses the checkpoint in one line (orchestrator/cli.py) instead of loading a slice
of a tensor that config.json describes wrongly.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from worker.arch.hf_config import ModelLoadError


class TensorSource(Protocol):
    """A checkpoint tensor that can be read whole or as a slice along one dimension."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


class InMemorySource:
    """A `TensorSource` over a tensor already in memory (tests, dummy weights, conversions)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.tensor.narrow(dim, start, (self.shape[dim] if stop is None else stop) - start)


class WeightShapeError(ModelLoadError):
    """A checkpoint tensor does not have the shape the config implies."""


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise WeightShapeError(
            f"{name}: checkpoint slice has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}; does config.json match the weights?"
        )
    dst.copy_(src)


def check_extent(source: TensorSource, dim: int, want: int, name: str) -> None:
    """A rank reads a slice, which copy_checked cannot tell from a wider tensor's: check all."""
    if source.shape and source.shape[dim] != want:
        raise WeightShapeError(f"{name}: checkpoint tensor has shape {source.shape}, the "
                               f"model expects {want} along dim {dim}; does config.json match "
                               "the weights?")


def empty_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    """A parameter the checkpoint fills (no gradient)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
