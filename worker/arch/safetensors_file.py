"""A safetensors file's header, read and checked against the file's size without torch.

A file cut short (a copy or download that stopped), or one that is not safetensors at all,
is one line naming it here, before any tensor is read: the launcher and `tandem plan` run it
before any worker starts (orchestrator/checkpoint.py), the worker before it opens the file
(worker/model/loader.py), where the safetensors library would raise its own error mid-load.
`weight_files` lists a checkpoint's files for both and checks each.

The format: 8 bytes little-endian header length N, N bytes of JSON (`{name: {dtype, shape,
data_offsets: [begin, end]}}`, plus an optional `__metadata__`), then the data, which the
tensors' offsets (relative to the data's start) must cover exactly.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from worker.arch.hf_config import ModelLoadError

_MAX_HEADER = 100 << 20  # safetensors refuses headers above 100 MB
# bits per element of the dtypes safetensors writes (F4: two to a byte)
_DTYPE_BITS = {"F64": 64, "I64": 64, "U64": 64, "F32": 32, "I32": 32, "U32": 32, "F16": 16,
               "BF16": 16, "I16": 16, "U16": 16, "I8": 8, "U8": 8, "BOOL": 8, "F8_E4M3": 8,
               "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4}
_FIX = "re-download or re-save it"
_OTHER_FORMATS = (".bin", ".pt", ".pth", ".gguf")


def weight_files(path: Path) -> list[Path]:
    """The safetensors files a worker reads from the checkpoint directory `path` (the shards
    its index lists, else model.safetensors, else every *.safetensors), each with a header that
    fits its size; ModelLoadError naming what is absent or cut short. The launcher's preflight
    (orchestrator/checkpoint.py) and the loader both list them here."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = _shards(index)
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in _OTHER_FORMATS)
        have = f" (it has {', '.join(other[:3])})" if other else ""
        raise ModelLoadError(
            f"{path}: no model.safetensors or model.safetensors.index.json{have}; only "
            "safetensors checkpoints load (re-save with transformers' save_pretrained), or serve "
            "random weights at the checkpoint's shapes with --set model.load_format=dummy")
    for f in files:
        read_header(f)
    return files


def _shards(index: Path) -> list[Path]:
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{index}: not valid JSON ({exc}); {_FIX}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index}: field 'weight_map' is missing or empty; re-download the "
                             "checkpoint")
    files = [index.parent / n for n in sorted(set(map(str, weight_map.values())))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} lists {len(missing)} shards that are absent (e.g. "
                             f"{missing[0]}); re-download the checkpoint")
    return files


def read_header(file: Path) -> dict[str, dict[str, Any]]:
    """The tensors' header entries ({dtype, shape, data_offsets}) by name; ModelLoadError
    naming the file and what is wrong when it is not safetensors or its data is cut short."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        raw = fh.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise ModelLoadError(f"{file}: not a safetensors file ({size} bytes, header length "
                                 f"{n}); {_FIX}")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: its safetensors header is not a JSON object; {_FIX}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    _check_extents(file, tensors, size - 8 - n)
    return tensors


def _check_extents(file: Path, tensors: dict[str, Any], data_bytes: int) -> None:
    """Every tensor's bytes inside the file, sized as its dtype and shape say; the data ends
    where the last tensor does."""
    end = 0
    for name, entry in tensors.items():
        try:
            begin, stop = (int(x) for x in entry["data_offsets"])
            numel = 1
            for dim in entry["shape"]:
                numel *= int(dim)
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{file}: header entry {name!r} lacks dtype, shape or "
                                 f"data_offsets; {_FIX}") from None
        bits = _DTYPE_BITS.get(dtype)
        if not 0 <= begin <= stop or (bits is not None and (numel * bits + 7) // 8 != stop - begin):
            raise ModelLoadError(f"{file}: tensor {name!r} has data_offsets [{begin}, {stop}] "
                                 f"that do not fit its {dtype} shape {entry['shape']}; {_FIX}")
        end = max(end, stop)
    if end != data_bytes:
        what = "truncated" if end > data_bytes else "longer than its tensors"
        raise ModelLoadError(f"{file}: {what}: its header's tensors need {end} bytes of data, "
                             f"the file holds {data_bytes} ({file.stat().st_size} bytes in all); "
                             f"{_FIX}")
