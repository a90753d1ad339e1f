"""The project's Triton kernels compiled for an H200 (sm_90) on any machine, GPU or not, and the
instructions that decide their speed counted (the lease's METHOD.md: read what costs no device
time). Triton's wheel carries ptxas, cuobjdump and nvdisasm, so this runs on the CPU dev box.

What it answers: are the global loads 16-byte cp.async (LDGSTS.E.BYPASS.128), do dot operands
come through ldmatrix (LDSM) or element by element (LDS.U8 / LDS.U16), how many registers, any
spills (STL/LDL), how much shared memory. Pointers and strides are compiled as Triton's JIT
specializes them for the engine's tensors (16-byte aligned, strides multiples of 16), which is
what makes its loads vectorize; without that the counts describe a different kernel.

    python -m bench.sass                       # every kernel in KERNELS, one line each
    python -m bench.sass decode_fp8 --dump /tmp/decode_fp8.sass
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Opcodes the one-line summary shows (the rest are in --dump).
SHOWN = ("LDGSTS", "LDG", "LDS", "LDSM", "STS", "HMMA", "F2FP", "HADD2", "FFMA", "PRMT", "STL",
         "LDL")


@dataclass
class Kernel:
    """One kernel to compile: its jit function, pointer element types by argument name (every
    other non-constexpr argument is an i32, or fp32 when named in `floats`), constexprs, launch
    options, and the arguments not specialized as multiples of 16."""

    fn: Callable[[], Any]
    pointers: dict[str, str]
    constexprs: dict[str, Any]
    floats: tuple[str, ...] = ()
    unaligned: tuple[str, ...] = ()
    options: dict[str, int] = field(default_factory=lambda: {"num_warps": 4, "num_stages": 2})


def _decode(fp8: bool, v_t: bool | None = None) -> Kernel:
    """The decode kernel as the 8B layer calls it at batch 8; V token-major over e4m3 pages as
    a KVCache keeps them (`v_t` False: the feature-major layout of bf16 pages)."""
    from worker.model.triton_decode import DECODE_CONFIGS, _get_kernels
    from worker.model.triton_pages import load_v_token_major

    cfg = DECODE_CONFIGS[fp8]
    kv = "fp8e4nv" if fp8 else "bf16"
    return Kernel(
        fn=lambda: _get_kernels()["decode"],
        pointers={"q_ptr": "bf16", "kc_ptr": kv, "vc_ptr": kv, "pt_ptr": "i32", "sl_ptr": "i32",
                  "o_ptr": "bf16", "op_ptr": "fp32", "lse_ptr": "fp32", "sinks_ptr": "bf16",
                  "ks_ptr": "fp32", "vs_ptr": "fp32"},
        constexprs=dict(G=4, BLOCK_G=16, D=128, PAGE=16, NUM_SPLITS=8, HAS_SINKS=False,
                        SCALED=fp8, BLOCK_N=cfg["BLOCK_N"], F16_DOT=cfg["F16_DOT"],
                        V_T=fp8 if v_t is None else v_t,
                        LOAD_V=load_v_token_major),
        floats=("scale_log2",),
        unaligned=("stride_qh", "stride_oh", "window", "scale_log2"),
        options={k: cfg[k] for k in ("num_warps", "num_stages", "maxnreg")  # as launched
                 if k in cfg and (k != "maxnreg" or v_t is not False)},
    )


def _prefill_fp8(v_t: bool = True) -> Kernel:
    from worker.model.triton_pages import load_v_token_major
    from worker.model.triton_prefill import _BLOCK_M, _BLOCK_N, _get_kernel

    return Kernel(
        fn=_get_kernel,
        pointers={"q_ptr": "bf16", "kc_ptr": "fp8e4nv", "vc_ptr": "fp8e4nv", "pt_ptr": "i32",
                  "qs_ptr": "i32", "qe_ptr": "i32", "sl_ptr": "i32", "sinks_ptr": "bf16",
                  "ks_ptr": "fp32", "vs_ptr": "fp32", "o_ptr": "bf16"},
        constexprs=dict(G=4, D=128, PAGE=16, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, HAS_SINKS=False,
                        SCALED=True, PRECISION="tf32", V_T=v_t, LOAD_V=load_v_token_major),
        floats=("scale_log2",),
        unaligned=("stride_qt", "stride_qh", "stride_ot", "stride_oh", "window", "scale_log2"),
    )


def _gemv_fp8(pair: bool) -> Kernel:
    """The one-token FP8 GEMV as the 8B layer calls it: gate|up with the norm folded in
    (pair), or o with the residual; K = 4096, 128 x 128 scale blocks."""
    from worker.model.gemv import _config, _kernels

    cfg = _config(4096, pair, pair, True)
    return Kernel(
        fn=lambda: _kernels().gemv,
        pointers={"x_ptr": "bf16", "w_ptr": "fp8e4nv", "b_ptr": "bf16", "nw_ptr": "bf16",
                  "r_ptr": "bf16", "out_ptr": "bf16", "s_ptr": "fp32"},
        constexprs=dict(K=4096, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PAIR=pair,
                        HAS_BIAS=False, NORM=pair, RESIDUAL=not pair, SCALED=True, SCALE_N=128,
                        SCALE_K=128),
        floats=("eps",),
        unaligned=("eps",),
        options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
    )


def _fused(name: str, quant: bool) -> Kernel:
    """The 8B layer's fused norm (hidden 4096, with the residual) or SiLU·mul (12288 wide),
    writing its row (bf16) or the next FP8 GEMM's input (quant: e4m3 and 128-group scales)."""
    from worker.model import fused_kernels

    out = {"q_ptr": "fp8e4nv", "s_ptr": "fp32"} if quant else {"q_ptr": "bf16", "s_ptr": "bf16"}
    if name == "norm":
        return Kernel(
            fn=lambda: fused_kernels.rms_norm_kernel,
            pointers={"x_ptr": "bf16", "r_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16",
                      "res_out_ptr": "bf16"} | out,
            constexprs=dict(H=4096, BLOCK=4096, HAS_RESIDUAL=True, QUANT=quant, GROUP=128),
            floats=("eps",), unaligned=("eps",), options={"num_warps": 8, "num_stages": 1})
    return Kernel(fn=lambda: fused_kernels.silu_mul_kernel,
                  pointers={"gu_ptr": "bf16", "out_ptr": "bf16"} | out,
                  constexprs=dict(INTER=12288, BLOCK=1024, QUANT=quant, GROUP=128),
                  options={"num_warps": 4, "num_stages": 1})


KERNELS: dict[str, Callable[[], Kernel]] = {
    "decode_bf16": lambda: _decode(False),
    "decode_fp8": lambda: _decode(True),
    "decode_fp8_feature_major": lambda: _decode(True, v_t=False),
    "prefill_fp8": _prefill_fp8,
    "prefill_fp8_feature_major": lambda: _prefill_fp8(False),
    "gemv_fp8_gate_up": lambda: _gemv_fp8(True),
    "gemv_fp8_o": lambda: _gemv_fp8(False),
    "add_rms_norm": lambda: _fused("norm", False),
    "add_rms_norm_fp8": lambda: _fused("norm", True),
    "silu_mul": lambda: _fused("silu", False),
    "silu_mul_fp8": lambda: _fused("silu", True),
}


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_sm90(kernel: Kernel) -> bytes:
    """The kernel's cubin for sm_90, compiled here (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn()
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in kernel.constexprs:
            signature[name] = "constexpr"
        elif name in kernel.pointers:
            signature[name] = "*" + kernel.pointers[name]
        else:
            signature[name] = "fp32" if name in kernel.floats else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(signature.items())
        if kind != "constexpr" and name not in kernel.unaligned
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=kernel.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=kernel.options)
    return bytes(compiled.asm["cubin"])


@dataclass
class Report:
    registers: int
    stack: int
    opcodes: collections.Counter[str]  # full opcode with modifiers, e.g. "LDS.U8"
    sass: str


def inspect(cubin: bytes) -> Report:
    """Registers, stack bytes and the opcode histogram of a cubin (cuobjdump, nvdisasm)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return Report(int(regs[1]) if regs else -1, int(stack[1]) if stack else -1,
                  collections.Counter(ops), sass)


def summary(name: str, report: Report) -> str:
    shown = sorted((op, n) for op, n in report.opcodes.items() if op.split(".")[0] in SHOWN)
    ops = " ".join(f"{op}:{n}" for op, n in shown)
    return f"{name}: {report.registers} registers, stack {report.stack} B | {ops}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="*", default=list(KERNELS), help=", ".join(KERNELS))
    ap.add_argument("--dump", type=Path, help="write the (one) kernel's SASS here")
    args = ap.parse_args()
    unknown = set(args.kernels) - set(KERNELS)
    if unknown:
        ap.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    for name in args.kernels:
        report = inspect(compile_sm90(KERNELS[name]()))
        print(summary(name, report), flush=True)
        if args.dump:
            args.dump.write_text(report.sass)


if __name__ == "__main__":
    main()
