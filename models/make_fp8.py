"""Make a block-scaled FP8 copy of an HF checkpoint (the DeepSeek-V3 / Qwen3-*-FP8 format).

    python -m models.make_fp8 SRC_DIR DST_DIR [--block 128 128] [--skip lm_head ...]

Every linear weight (a 2-D `*.weight` of the decoder layers: attention and MLP projections,
MoE experts) becomes float8_e4m3fn with one float32 scale per 128×128 block in
`*.weight_scale_inv` (weight ≈ fp8 · scale_inv; each block's largest |value| maps to 448).
Embeddings, the LM head, norms and MoE routers keep the source dtype, as in the published
FP8 checkpoints. config.json gains `quantization_config` {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size}; the other files (tokenizer, generation
config) and the models beside it (subdirectories with a config.json: drafters) are copied.
Tandem serves the copy like any checkpoint: FP8 linears on CUDA, weights dequantized at load
on the CPU (worker/model/fp8.py). Shards keep their file names; the
index (if any) is rewritten with the new tensor names.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.hub import HubModelError, looks_like_repo_id, resolve_repo_id  # noqa: E402
from worker.model.fp8 import quantize_blockwise  # noqa: E402

# Tensors that stay in the source dtype (substrings of their names): as DeepSeek-V3's release
# keeps them, the MTP layer's copy of the LM head (shared_head.head) and the router (mlp.gate)
# too; its e_score_correction_bias is 1-D and never quantized.
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "router", "shared_head.head")


def quantized(name: str, tensor: torch.Tensor, skip: tuple[str, ...]) -> bool:
    """Whether a checkpoint tensor is a linear weight to store in FP8."""
    return (
        name.endswith(".weight")
        and tensor.dim() == 2
        and ".layers." in name
        and not any(k in name for k in (*KEEP, *skip))
    )


def convert(
    src: Path, dst: Path, block: tuple[int, int] = (128, 128), skip: tuple[str, ...] = ()
) -> int:
    """Write the FP8 copy of `src` into `dst`; returns how many tensors were quantized."""
    if dst.resolve() == src.resolve():  # in place would overwrite the source's weights
        raise SystemExit(f"{dst} is the source checkpoint; write the FP8 copy to another directory")
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}: no config.json; point SRC at an HF checkpoint directory")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise SystemExit(
            f"{src}/config.json already has a quantization_config; convert the unquantized "
            "checkpoint"
        )
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(
            f"{src}: no *.safetensors files; save the checkpoint with safetensors first"
        )
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    count = total_size = 0
    for f in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensor = handle.get_tensor(name)
                if quantized(name, tensor, skip):
                    q, scale_inv = quantize_blockwise(tensor, *block)
                    out[name], out[name + "_scale_inv"] = q, scale_inv
                    count += 1
                else:
                    out[name] = tensor.contiguous()
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
        total_size += sum(t.numel() * t.element_size() for t in out.values())
    index = src / "model.safetensors.index.json"
    if index.exists():
        # total_size is the copy's own (tools size downloads and memory by it)
        meta = {**json.loads(index.read_text()).get("metadata", {}), "total_size": total_size}
        (dst / index.name).write_text(
            json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2)
        )
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", *skip],
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for other in src.iterdir():
        if (
            other.is_file()
            and other.suffix != ".safetensors"
            and other.name not in ("config.json", index.name)
        ):
            shutil.copy(other, dst / other.name)
        elif other.is_dir() and (other / "config.json").is_file():
            # a model beside the checkpoint (a drafter: speculative.model "" is
            # <model.path>/<method>), as it is; other folders (Llama's original/) stay behind
            shutil.copytree(other, dst / other.name, dirs_exist_ok=True)
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "src",
        type=Path,
        help="HF checkpoint directory (bf16 / fp16 / fp32 safetensors), or ORG/NAME in the local "
        "Hugging Face cache",
    )
    ap.add_argument("dst", type=Path, help="output directory (created)")
    ap.add_argument(
        "--block",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("N", "K"),
        help="weight_block_size: output rows x input columns per scale (default 128 128)",
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        metavar="NAME",
        help="more tensor-name substrings to keep unquantized (listed in modules_to_not_convert)",
    )
    args = ap.parse_args(argv)
    if min(args.block) <= 0:
        ap.error(f"--block takes two positive ints (rows, columns per scale), got {args.block}")
    src = args.src
    if not src.exists() and looks_like_repo_id(str(src)):  # as `tandem serve --model ORG/NAME`
        try:
            src = resolve_repo_id(str(src))
        except HubModelError as exc:
            raise SystemExit(str(exc)) from None
    n = convert(src, args.dst, (args.block[0], args.block[1]), tuple(args.skip))
    print(
        f"wrote {args.dst}: {n} linear weights in FP8 with {args.block[0]}x{args.block[1]} block "
        "scales"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
