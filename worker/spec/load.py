"""Load the model drafter `speculative.method` names, next to the target it drafts for.

Every rank of a worker (and both sides of a PD pair) loads the same head the same way: its
layer count sizes the KV cache (`KVShape.draft_layers`) and its label enters the layout
contract, so a prefill and a decode worker with different drafters are refused at bootstrap.

- eagle: an EAGLE head directory (`speculative.model`, default `<model.path>/eagle`):
  config.json with `"model_type": "eagle"`, the target's layer config and `target_architecture`
  (models/train_eagle.py writes one), model.safetensors with `fc.weight`, `layers.0.*`,
  `norm.weight`.
- draft: an HF checkpoint of the Llama / Qwen family (default `<model.path>/draft`) with the
  target's token ids (its tokenizer, or one the target's extends with more tokens) and KV head
  geometry (its KV lives in the target's pages).
- mtp: the target checkpoint's own MTP layer (DeepSeek-V3, Qwen3-Next); for a dense target
  without one, an MTP module in DeepSeek's layout trained beside it (default `<model.path>/mtp`,
  `"model_type": "mtp"`, `eh_proj`, `enorm`, `hnorm`, `layers.0.*`, `shared_head.norm`).
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.arch.drafter import (
    MODEL_METHODS,
    check_drafter,
    mtp_weights_missing,
    own_mtp_layers,
)
from worker.arch.hf_config import ModelLoadError, parse_arch_config
from worker.arch.load import load_arch_config, read_json
from worker.cache_layout import max_model_len
from worker.config import ConfigError, ModelConfig, WorkerConfig
from worker.model import fused
from worker.model.backends import get_attention_backend
from worker.model.base import CausalLM, ModelSpec
from worker.model.deepseek_v3 import DeepseekV3ForCausalLM
from worker.model.layers import Embedding, RMSNorm
from worker.model.llama import MLP, Attention, LlamaForCausalLM
from worker.model.loader import (
    fingerprint,
    init_dummy,
    iter_checkpoint,
    load_model,
    tp_info,
    weight_files,
)
from worker.model.qwen3_next import Qwen3NextForCausalLM
from worker.spec.heads import (
    DeepseekMTPHead,
    DenseMTPHead,
    DraftHead,
    DraftLM,
    EagleHead,
    Qwen3NextMTPHead,
    target_parts,
)

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class LoadedHead:
    head: DraftHead
    label: str  # the layout contract's `speculative`: method, layers, the head's fingerprint


def load_head(config: WorkerConfig, target: CausalLM, spec: ModelSpec) -> LoadedHead | None:
    """The drafter network of a model method (None for none / ngram). Every error names the
    field and the fix (ConfigError)."""
    method = config.speculative.method
    if method not in MODEL_METHODS:
        return None
    path = Path(config.speculative.drafter_path(config.model.path))
    target_dir = Path(config.model.path)
    check_drafter(method, load_arch_config(target_dir), target_dir, path,
                  max_model_len(spec, config), config.parallel.dp_size)
    if method == "mtp":
        return _mtp(config, target, spec)
    try:
        if method == "eagle":
            head, files = _dense_head(path, config, target, spec, "eagle")
        else:
            head, files = _draft(path, config, spec)
    except ModelLoadError as exc:
        raise ConfigError(f"speculative.model {str(path)!r}: {exc}") from None
    label = f"{method}:{head.num_layers}:{_digest(path, files, config)}"
    log.info("speculative.method=%s: drafter %s (%s; its KV in the target's pages)", method,
             path, label)
    return LoadedHead(head, label)


def _mtp(config: WorkerConfig, target: CausalLM, spec: ModelSpec) -> LoadedHead:
    """The checkpoint's own MTP layer; for a dense target without one, an MTP module trained
    beside it (`speculative.model`, default `<model.path>/mtp`)."""
    head: DraftHead
    if isinstance(target, DeepseekV3ForCausalLM) and len(target.mtp):
        head = DeepseekMTPHead(target)
    elif isinstance(target, Qwen3NextForCausalLM) and target.mtp is not None:
        head = Qwen3NextMTPHead(target)
    else:  # no MTP layer of its own (config.json declares one the weights lack, or none)
        path = Path(config.speculative.drafter_path(config.model.path))
        arch = load_arch_config(Path(config.model.path))
        if own_mtp_layers(arch):  # check_drafter passed it on as the checkpoint's own
            raise ConfigError(mtp_weights_missing(arch, config.model.path))
        try:
            head, files = _dense_head(path, config, target, spec, "mtp")
        except ModelLoadError as exc:
            raise ConfigError(f"speculative.model {str(path)!r}: {exc}") from None
        return LoadedHead(head, f"mtp:{head.num_layers}:{_digest(path, files, config)}")
    return LoadedHead(head, f"mtp:{head.num_layers}")


def _digest(path: Path, files: list[Path], config: WorkerConfig) -> str:
    """The drafter checkpoint's identity for the contract (dummy weights: their seed)."""
    if files:
        return hashlib.sha256(fingerprint(path, files).encode()).hexdigest()[:16]
    return f"dummy{config.model.seed + 1}"


def _dense_head(path: Path, config: WorkerConfig, target: CausalLM, spec: ModelSpec,
                layout: str) -> tuple[DraftHead, list[Path]]:
    """An EAGLE head, or a side-trained MTP module (`layout`), for a dense target."""
    raw = read_json(path / "config.json")  # checked against the target by check_drafter
    assert isinstance(target, LlamaForCausalLM), spec.architecture  # check_drafter's EAGLE_TARGETS
    arch = parse_arch_config({**raw, "architectures": [spec.architecture]}, None,
                             str(path / "config.json"))
    if raw.get("target_fingerprint") not in (None, spec.fingerprint):
        log.warning("the head at %s was trained against another checkpoint than %s "
                    "(target_fingerprint differs): drafts stay lossless but fewer are accepted; "
                    "re-run models/train_eagle.py", path, config.model.path)
    device = torch.device(config.parallel.device)
    tp = tp_info(config.parallel)
    cls = EagleHead if layout == "eagle" else DenseMTPHead
    with torch.device("meta"):
        head = cls(arch, target_parts(target), spec.num_layers, tp,
                   get_attention_backend(device), spec.dtype)
    head = head.to_empty(device=device)
    for module in head.modules():
        if isinstance(module, Attention):  # FP8 KV scales: the head's layer has none (1.0)
            module.k_scale.fill_(1.0)  # type: ignore[operator]
            module.v_scale.fill_(1.0)  # type: ignore[operator]
    if config.model.load_format == "dummy":  # benchmarks at real shapes: config.json only
        init_dummy(head, config.model.seed + 1)  # type: ignore[arg-type]
        files: list[Path] = []
    else:
        files = weight_files(path)
        _fill(head, files)
    if fused.available(device):  # the target's CUDA kernels for the head's layer too
        for module in head.modules():
            if isinstance(module, (RMSNorm, Attention, MLP, Embedding)):
                module.fused = True
    return head.eval(), files


def _fill(head: nn.Module, files: list[Path]) -> None:
    """Every tensor the head names, exactly once."""
    slots = head.weight_slots()  # type: ignore[operator]
    loaded: set[str] = set()
    with ExitStack() as stack:
        for name, source in iter_checkpoint(files, stack):
            slot = slots.get(name)
            if slot is not None:
                slot.module.load(slot.param, source, slot.shard_id)
                loaded.add(name)
    missing = sorted(set(slots) - loaded)
    if missing:
        raise ModelLoadError(f"the head's checkpoint lacks {len(missing)} tensors, e.g. "
                             f"{missing[:3]}; re-run models/train_eagle.py")


def _draft(path: Path, config: WorkerConfig, spec: ModelSpec) -> tuple[DraftHead, list[Path]]:
    """A draft model whose config.json check_drafter accepted."""
    dtype = _DTYPE_NAMES.get(spec.dtype)
    if dtype is None:
        raise ConfigError(f"speculative.method=draft: the target runs in {spec.dtype}; a draft "
                          "model needs float32, bfloat16 or float16")
    # A dummy target gets a dummy draft (benchmarks at real shapes; config.json only).
    model_cfg = ModelConfig(path=str(path), dtype=dtype,  # type: ignore[arg-type]
                            load_format=config.model.load_format, seed=config.model.seed + 1)
    lm, dspec = load_model(model_cfg, config.parallel)
    assert isinstance(lm, LlamaForCausalLM) and not dspec.state_layers, dspec.architecture
    files = weight_files(path) if config.model.load_format != "dummy" else []
    return DraftLM(lm, spec.num_layers), files
