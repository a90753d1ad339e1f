"""Load an HF-format checkpoint directory (or dummy weights at its shapes) into our model.

1. Read config.json (+ generation_config.json) into an `ArchConfig`; refuse what we cannot run.
2. Build the model on the meta device (no memory), then materialize it once on the target
   device with `to_empty` — an 8B config never allocates twice.
3. Fill it: real weights stream tensor by tensor from `model.safetensors` or the shards in
   `model.safetensors.index.json`, read lazily with `safe_open` so each layer reads only its
   slice (tensor parallelism); or dummy weights (norms 1, the rest small normal, seeded),
   drawn where the model lives.
4. Compute the fingerprint: sha256 over config.json bytes and each safetensors file's name,
   size and header — cheap, and it changes whenever weights or config change.

FP8 (worker/model/fp8.py): a block-scaled checkpoint's `X.weight` arrives paired with its
`X.weight_scale_inv` as one `BlockFp8Source`; on CUDA (with triton) the linears keep FP8, on the
CPU the loader builds them in the model dtype and the source dequantizes each slice as it is
read (at load: once, no FP8 compute on the CPU). K/V cache scales (`self_attn.k_scale`, ...)
are collected whole and each rank's attention layers take their heads' values (1.0 where the
checkpoint has none); `ModelSpec.kv_scales` names them for the log and the layout contract.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from transfer.contract import heads_of_rank
from worker.arch.fp8_config import GPU_BLOCK_K, BlockFp8Config, Fp8Error
from worker.arch.hf_config import ArchConfig, ModelLoadError
from worker.arch.load import load_arch_config
from worker.arch.safetensors_file import weight_files
from worker.config import ModelConfig, ParallelConfig
from worker.model import fp8, fp8_gemm, fused
from worker.model.backends import get_attention_backend
from worker.model.base import CausalLM, ModelSpec
from worker.model.deepseek_v3 import DeepseekV3ForCausalLM
from worker.model.gpt_oss import GptOssForCausalLM
from worker.model.layers import Embedding, RMSNorm, TPInfo
from worker.model.llama import LlamaForCausalLM
from worker.model.moe import MoEParallel, check_deepep
from worker.model.qwen3_moe import Qwen3MoeForCausalLM
from worker.model.qwen3_next import Qwen3NextForCausalLM
from worker.model.weights import TensorSource, WeightShapeError

log = logging.getLogger(__name__)

_MODEL_CLASSES: dict[str, Callable[..., CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DUMMY_STD = 0.02  # the usual initializer_range: activations stay finite through deep stacks
_FP_SAMPLES, _FP_SAMPLE = 16, 4096  # data samples per file for the fingerprint, bytes each
_DUMMY_BLOCK = 1 << 24  # elements drawn per randn call (64 MiB of float32)
# dummy FP8 weights: e4m3 values of this spread, their scales bring them to N(0, 0.02)
_DUMMY_FP8_STD = 16.0


class SafetensorsSource:
    """A `TensorSource` over one tensor of an open safetensors file; reads only what is asked."""

    def __init__(self, handle: object, name: str) -> None:
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    @property
    def is_fp8(self) -> bool:
        return str(self._slice.get_dtype()).startswith("F8")

    def read(self, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if not self.shape:  # a scalar (e.g. a per-tensor K/V cache scale) has nothing to slice
            return self._slice[()]
        stop = self.shape[dim] if stop is None else stop
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._slice[index]


def fingerprint(path: Path, files: list[Path]) -> str:
    """sha256 over config.json and each safetensors file's name, size, JSON header and a
    few evenly spaced samples of its data.

    Header and size alone say nothing about the values (a retrained checkpoint has the same
    ones), so a fixed handful of small reads samples the data too: still a few milliseconds
    for a many-GB checkpoint, and it tells two trainings of one architecture apart.
    """
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode())
            h.update(str(size).encode())
            h.update(fh.read(header_len))
            data_start = 8 + header_len
            span = max(size - data_start - _FP_SAMPLE, 0)
            for i in range(_FP_SAMPLES):
                fh.seek(data_start + span * i // max(_FP_SAMPLES - 1, 1))
                h.update(fh.read(_FP_SAMPLE))
    return h.hexdigest()


def resolve_dtype(model: ModelConfig, arch: ArchConfig, device: torch.device) -> torch.dtype:
    if model.dtype != "auto":
        if model.dtype not in _DTYPE_NAMES:
            raise ModelLoadError(
                f"model.dtype {model.dtype!r} is not one of auto|float32|bfloat16|float16"
            )
        return _DTYPE_NAMES[model.dtype]
    if arch.dtype == "float16" and device.type == "cpu":
        # fp16 matmul on CPU runs at a few GFLOP/s; float32 is exact for fp16 weights.
        log.info("checkpoint is float16; loading as float32 on CPU (set model.dtype to override)")
        return torch.float32
    return _DTYPE_NAMES[arch.dtype]


_SCALE_INV = "_scale_inv"  # X.weight's block scales are X.weight_scale_inv


def iter_checkpoint(
    files: list[Path],
    stack: ExitStack,
    quant: BlockFp8Config | None = None,
) -> Iterator[tuple[str, SafetensorsSource | fp8.BlockFp8Source]]:
    """Every tensor of the checkpoint; an FP8 weight comes with its block scales (the scale
    tensor is not yielded on its own). Shards may hold a weight and its scales apart."""
    handles: dict[str, object] = {}
    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        except SafetensorError as exc:  # what read_header cannot see; one line, not a traceback
            raise ModelLoadError(f"{f}: the safetensors library cannot read it ({exc}); "
                                 "re-download or re-save it") from None
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            handles[name] = handle
    for name, handle in handles.items():
        if name.endswith(_SCALE_INV) and name.removesuffix(_SCALE_INV) in handles:
            continue  # read with its weight
        source = SafetensorsSource(handle, name)
        scale = handles.get(name + _SCALE_INV)
        if scale is None:
            if source.is_fp8:
                raise ModelLoadError(
                    f"{name} is FP8 but the checkpoint has no {name}{_SCALE_INV}; "
                    "only "
                    "block-scaled FP8 checkpoints are supported "
                    "(models/make_fp8.py makes one)"
                )
            yield name, source
        elif quant is None:
            raise ModelLoadError(
                f"{name} has block scales ({name}{_SCALE_INV}) but config.json "
                "has no "
                "quantization_config; is this an FP8 checkpoint with its "
                "config.json?"
            )
        else:
            try:
                yield (
                    name,
                    fp8.BlockFp8Source(
                        name, source, SafetensorsSource(scale, name + _SCALE_INV), quant
                    ),
                )
            except Fp8Error as exc:
                raise ModelLoadError(str(exc)) from None


_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def check_tied_head(embed: Embedding, head: TensorSource) -> None:
    """tie_word_embeddings with an lm_head.weight in the checkpoint: an equal copy is fine (torch
    .bin exports write both); a different one means the config does not describe the weights
    (transformers 4 ties, 5 keeps the separate head), so it is refused rather than guessed."""
    mine = embed.weight.data[: embed.stop - embed.start]  # [V_local, hidden]: this rank's rows
    same_shape = tuple(head.shape) == (embed.vocab_size, mine.shape[1])
    if same_shape and torch.equal(head.read(0, embed.start, embed.stop).to(mine.dtype), mine):
        return
    raise ModelLoadError(
        "config.json: tie_word_embeddings is true but the checkpoint's lm_head.weight differs "
        "from model.embed_tokens.weight; set tie_word_embeddings to false to serve that head, "
        "or remove lm_head.weight to tie"
    )


def load_checkpoint(
    model: CausalLM,
    files: list[Path],
    quant: BlockFp8Config | None = None,
    kv_scales: fp8.KVScales | None = None,
) -> None:
    """Stream every tensor into its slot; every slot must be filled exactly once. K/V cache
    scales go to `kv_scales` (they are optional: a checkpoint may have none)."""
    slots = model.weight_slots()
    loaded: set[str] = set()
    ignored: list[str] = []
    tied_head: TensorSource | None = None
    with ExitStack() as stack:
        for name, source in iter_checkpoint(files, stack, quant):
            if kv_scales is not None and fp8.kv_scale_target(name) is not None:
                try:
                    kv_scales.add(name, source.read())
                except Fp8Error as exc:
                    raise ModelLoadError(str(exc)) from None
                continue
            slot = slots.get(name)
            if slot is None:
                ignored.append(name)  # e.g. rotary inv_freq buffers, a tied lm_head copy
                if name == _LM_HEAD:
                    tied_head = source  # checked against the embedding once that is loaded
                continue
            try:
                slot.module.load(slot.param, source, slot.shard_id)  # type: ignore[operator]
            except WeightShapeError as exc:  # the layer names its parameter; say which tensor
                raise WeightShapeError(f"checkpoint tensor {name}: {exc}") from None
            loaded.add(name)
        embed = slots[_EMBED].module if _EMBED in loaded else None
        if tied_head is not None and isinstance(embed, Embedding):
            check_tied_head(embed, tied_head)
    model.drop_unloaded(loaded)  # optional modules the checkpoint lacks (DeepSeek's MTP layers)
    missing = sorted(set(model.weight_slots()) - loaded)
    if missing:
        where = files[0] if len(files) == 1 else files[0].parent
        raise ModelLoadError(
            f"{where}: checkpoint lacks {len(missing)} tensors the config needs, e.g. "
            f"{missing[:4]}; does "
            "config.json (architectures, tie_word_embeddings, attention_bias) match the weights?"
        )
    if ignored:
        log.info(
            "ignored %d checkpoint tensors not used by the model, e.g. %s",
            len(ignored),
            ignored[:3],
        )


@torch.no_grad()
def init_dummy(model: CausalLM, seed: int) -> None:
    """Random weights at the real shapes: norms 1 (so activations keep their scale), rest
    N(0, 0.02).

    Drawn on the model's device from a generator seeded there: the same seed gives the same
    weights on the same kind of device (CPU: the same on every machine; CUDA: torch's Philox
    stream, whose layout depends on the GPU model, so the same on every GPU of one model). On
    a GPU this takes well under a second for an 8B model; drawing on the CPU took ~70 s.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        if id(p) in norm_weights:
            p.fill_(1.0)
        elif name.endswith("weight_scale_inv"):  # FP8 weights: e4m3 values ~N(0, 16²) times this
            p.fill_(_DUMMY_STD / _DUMMY_FP8_STD)
        elif fp8.is_fp8(p):  # no normal_ for float8: draw in float32, in row blocks
            step = max(1, _DUMMY_BLOCK // p.shape[1])
            for r in range(0, p.shape[0], step):
                block = p[r : r + step]
                block.copy_(torch.randn(block.shape, generator=gen, device=device) * _DUMMY_FP8_STD)
        elif device.type != "cpu":
            p.normal_(0.0, _DUMMY_STD, generator=gen)  # in p's dtype, in place: no staging copy
        else:
            # float32 then cast (bf16 draws directly would change every CPU model's weights); in
            # row blocks so the float32 staging copy stays small for big matrices.
            flat = p.view(p.shape[0], -1) if p.dim() > 1 else p.view(1, -1)  # [rows, cols]
            step = max(1, _DUMMY_BLOCK // flat.shape[1])
            for r in range(0, flat.shape[0], step):
                block = flat[r : r + step]
                block.copy_(torch.randn(block.shape, generator=gen) * _DUMMY_STD)


def tp_info(parallel: ParallelConfig) -> TPInfo:
    """Attention TP group of this rank, over the process group the caller initialized.

    Ranks are numbered dp-major: DP group d holds ranks [d*tp, (d+1)*tp). With dp_size 1 the
    TP group is the default group.
    """
    world = parallel.world_size
    if world == 1:
        return TPInfo()
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise ModelLoadError(
            f"parallel.tp_size*dp_size={world} needs torch.distributed initialized with world size "
            f"{world} (one process per rank) before load_model"
        )
    if dist.get_rank() % parallel.tp_size != parallel.tp_rank:
        raise ModelLoadError(
            f"parallel.tp_rank={parallel.tp_rank} but this process is rank {dist.get_rank()}"
        )
    if parallel.dp_size == 1:
        return TPInfo(size=parallel.tp_size, rank=parallel.tp_rank)
    tp = parallel.tp_size
    # new_group is collective: every rank creates every DP group's TP group, in order.
    groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(parallel.dp_size)]
    return TPInfo(size=tp, rank=parallel.tp_rank, group=groups[dist.get_rank() // tp])


def moe_parallel(parallel: ParallelConfig) -> MoEParallel:
    """MoE layers span every rank of the worker: by expert (ep_size > 1) or by feature (MoE TP)."""
    if parallel.all2all_backend == "deepep":
        check_deepep(torch.device(parallel.device))
    rank = dist.get_rank() if parallel.world_size > 1 else 0
    return MoEParallel(
        size=parallel.world_size,
        rank=rank,
        ep=parallel.ep_size > 1,
        tokens_replicated=parallel.dp_size == 1,
        backend=parallel.all2all_backend,
    )


def fp8_linears_here(arch: ArchConfig, device: torch.device) -> ArchConfig:
    """The architecture as this device builds it: FP8 linears only on CUDA with triton; elsewhere
    (the CPU) they are built in the model dtype and their weights dequantized at load."""
    if arch.quant is None:
        return arch
    if fused.available(device) and not arch.quant.gpu_kernels_take:
        log.warning(
            "FP8 checkpoint's quantization_config.weight_block_size [%d, %d]: the FP8 kernels "
            "take block_k %s; weights dequantized at load to the model dtype (twice or more "
            "the FP8 bytes)",
            arch.quant.block_n,
            arch.quant.block_k,
            "|".join(map(str, GPU_BLOCK_K)),
        )
        return dataclasses.replace(arch, quant=None)
    if fused.available(device):
        log.info(
            "FP8 block-scaled checkpoint (blocks %dx%d): linears keep FP8 weights "
            "(%s GEMM, Triton GEMV)",
            arch.quant.block_n,
            arch.quant.block_k,
            "cuBLAS blockwise" if fp8_gemm.cublas_blockwise(device) else "Triton",
        )
        return arch
    log.info(
        "FP8 block-scaled checkpoint: weights dequantized at load to the model dtype "
        "(%s has no FP8 kernels)",
        device.type,
    )
    return dataclasses.replace(arch, quant=None)


def set_kv_scales(model: CausalLM, scales: fp8.KVScales, tp: TPInfo) -> None:
    """Give every attention layer its rank's K/V cache scales (1.0 where the checkpoint has
    none). Checkpoint scales of layers with no such attention are dropped, with a warning."""
    heads = heads_of_rank(scales.num_kv_heads, tp.size, tp.rank)
    takers = {
        m.layer
        for m in model.modules()
        if isinstance(getattr(m, "k_scale", None), torch.Tensor)
        and isinstance(getattr(m, "layer", None), int)
    }
    dropped = scales.keep(takers)  # type: ignore[arg-type]
    if dropped:
        log.warning(
            "the checkpoint's K/V cache scales of layers %s are not used: this model's "
            "attention there (MLA latent pages, Qwen3-Next, linear attention) stores FP8 KV at "
            "scale 1.0",
            dropped,
        )
    for module in model.modules():
        if isinstance(getattr(module, "k_scale", None), torch.Tensor) and isinstance(
            getattr(module, "layer", None), int
        ):
            layer: int = module.layer  # type: ignore[assignment]
            for side in ("k", "v"):
                buf: torch.Tensor = getattr(module, f"{side}_scale")
                buf.copy_(scales.local(side, layer, heads).to(buf.device))


def check_head_dim(arch: ArchConfig, device: torch.device, source: str) -> None:
    """CUDA's Triton paged attention (decode and prefill) holds a K/V head in one tile: a power
    of two of at least 16 elements (`tl.arange` and the 16-bit `tl.dot`). Any other head_dim
    (head_dim 80 or 100, as some Llama / Mistral checkpoints have, or a tiny test model's 8)
    failed to compile at the first step, a traceback after start-up; refused here in one line.
    MLA models attend through their own kernels (worker/model/triton_mla.py)."""
    d = arch.head_dim
    if arch.kv_latent_dim or not fused.available(device) or (d >= 16 and d & (d - 1) == 0):
        return
    raise ModelLoadError(
        f"{source}: head_dim {d} (config.json's head_dim, else hidden_size / "
        "num_attention_heads) is not supported on CUDA: its attention kernels take a power of "
        "two of at least 16 (e.g. 64, 128); serve this checkpoint on the CPU (parallel.device: cpu)"
    )


def load_model(model: ModelConfig, parallel: ParallelConfig) -> tuple[CausalLM, ModelSpec]:
    """Build and fill the model described by `model.path` for this rank."""
    path = Path(model.path)
    device = torch.device(parallel.device)
    checkpoint_arch = load_arch_config(path)
    check_head_dim(checkpoint_arch, device, str(path / "config.json"))
    arch = fp8_linears_here(checkpoint_arch, device)
    dtype = resolve_dtype(model, arch, device)
    tp = tp_info(parallel)
    cls = _MODEL_CLASSES[arch.architecture]
    extra = {"moe": moe_parallel(parallel)} if arch.moe is not None else {}
    with torch.device("meta"):
        lm = cls(arch, tp, get_attention_backend(device), dtype, rope_device=device, **extra)
    lm = lm.to_empty(device=device)
    kv_scales = fp8.KVScales(arch.num_layers, arch.num_kv_heads)
    if model.load_format == "dummy":
        init_dummy(lm, model.seed)
        # Dummy weights depend on the device kind they were drawn on (see init_dummy): a CPU
        # worker and a GPU worker with one seed hold different models and must not pair.
        fp = f"dummy:{model.seed}" if device.type == "cpu" else f"dummy:{model.seed}:{device.type}"
    elif model.load_format == "auto":
        files = weight_files(path)
        load_checkpoint(lm, files, checkpoint_arch.quant, kv_scales)
        fp = fingerprint(path, files)
    else:
        raise ModelLoadError(f"model.load_format {model.load_format!r} is not one of auto|dummy")
    set_kv_scales(lm, kv_scales, tp)
    lm.eval()
    if fused.available(device):
        lm.set_fused_kernels(True)  # Triton norm / RoPE / SiLU·mul kernels (worker/model/fused*.py)
    spec = ModelSpec(
        architecture=arch.architecture,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.context_limit,  # extended by its RoPE scaling
        eos_token_ids=arch.eos_token_ids,
        dtype=dtype,
        fingerprint=fp,
        sliding_window=arch.sliding_window,
        layer_windows=arch.layer_windows,
        state_layers=lm.state_layers(),
        state_shape=lm.state_shape(),
        kv_latent_dim=arch.kv_latent_dim,
        kv_scales=kv_scales.label(),
        prefix_cache_exact=arch.rope.rope_type != "dynamic",
    )
    if not spec.prefix_cache_exact:
        log.info("dynamic NTK RoPE: a cached page's keys hold another request's rotation; "
                 "prefix-cache hits are off for this model")
    return lm, spec
