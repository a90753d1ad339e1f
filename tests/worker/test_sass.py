"""The FP8 attention kernels as ptxas builds them for an H200, compiled on the CPU
(bench/sass.py). Over token-major V pages (what a KVCache keeps for e4m3) V reaches the PV dot
through plain ldmatrix with no float16 round trip through shared memory; over feature-major
e4m3 pages through ldmatrix.trans after its conversion. Never as single bytes gathered from
shared memory, and nothing spills."""

from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
    pytest.skip("this triton wheel carries no CUDA tools", allow_module_level=True)

from bench.sass import KERNELS, compile_sm90, inspect  # noqa: E402


@pytest.mark.parametrize("name", ["decode_fp8", "prefill_fp8"])
def test_token_major_v_reaches_the_dot_without_a_round_trip(name: str) -> None:
    report = inspect(compile_sm90(KERNELS[name]()))
    assert report.opcodes["LDS.U8"] == 0 and report.opcodes["LDSM.16.MT88.4"] == 0, report.opcodes
    assert report.opcodes["LDSM.16.M88.4"] > 0, report.opcodes
    # the feature-major layout stores V's float16 conversion back to shared memory
    feature = inspect(compile_sm90(KERNELS[f"{name}_feature_major"]())).opcodes
    assert report.opcodes["STS.128"] < feature["STS.128"], (report.opcodes, feature)
    assert report.stack == 0 and report.opcodes["STL"] == 0


@pytest.mark.parametrize("name", ["decode_fp8_feature_major", "prefill_fp8_feature_major"])
def test_feature_major_v_goes_through_ldmatrix_trans(name: str) -> None:
    report = inspect(compile_sm90(KERNELS[name]()))
    assert report.opcodes["LDS.U8"] == 0, report.opcodes
    assert report.opcodes["LDSM.16.MT88.4"] > 0, report.opcodes
    assert report.stack == 0 and report.opcodes["STL"] == 0
