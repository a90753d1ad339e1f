"""Which fast paths a worker turns on: overlapped scheduling, piecewise and mixed CUDA graphs.

Both are decisions about the config and the loaded model, made once at start-up, apart from
the engine loop that then runs whichever path was chosen (worker/engine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.config import WorkerConfig
from worker.model import fused
from worker.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from worker.engine import Engine


def piecewise_supported(engine: Engine) -> bool:
    """Graphs around attention (worker/piecewise.py): dense one-rank models whose layers read
    nothing of the batch outside attention (no window rings, no recurrent state, no MoE)."""
    shape = engine.kv.shape
    return (engine.config.model.piecewise_graphs and engine.tp is None
            and type(engine.model) is LlamaForCausalLM and not shape.window_layers
            and not shape.state_layers)


def mixed_graphs_supported(engine: Engine) -> bool:
    """Whole-step graphs for steps with prompt tokens (worker/mixed_graphs.py): where piecewise
    graphs run and attention is the Triton backend's (its mixed-rows path)."""
    return (engine.config.model.mixed_graphs and piecewise_supported(engine)
            and fused.available(engine.device))


def overlap_enabled(config: WorkerConfig, device: torch.device) -> bool:
    """`scheduler.overlap`: auto = on for a single-rank CUDA worker. Multi-rank workers send each
    step's input ids to their followers from the host, so a PENDING id cannot travel there."""
    mode, par = config.scheduler.overlap, config.parallel
    multi_rank = par.world_size > 1 or par.nnodes > 1
    config.scheduler.check_overlap(multi_rank, config.speculative.enabled)
    if config.speculative.enabled:
        return False
    return mode == "on" or (mode == "auto" and device.type == "cuda" and not multi_rank)
