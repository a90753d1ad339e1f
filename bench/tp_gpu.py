"""Decode tok/s on two GPUs (issue 23): TP=1 vs TP=2 dense, and DP=2 attention x EP=2 MoE.

    python3 bench/tp_gpu.py [--sections dense,moe] [--batches 1,64] [--new-tokens 128] [--out DIR]

dense: bench/models/qwen3-8b-shape (8.19 B, bf16, dummy weights). Layouts, one after the other
in this process: TP=1 on GPU 0 (decode graphs + overlapped decode, the single-rank default),
TP=1 with plain steps (`scheduler.overlap: off`, as multi-rank workers step), TP=2 over GPUs 0
and 1 with decode graphs captured on both ranks, TP=2 eager (no graphs: what multi-rank workers
ran before issue 23).
moe: bench/models/qwen3-30b-a3b-shape (30.5 B, 128 experts top-8, bf16, dummy weights): one GPU
(graphs: the static MoE path) vs DP=2 attention x EP=2 with graphs and eager.

Decode: B requests of 512 random prompt tokens, `--new-tokens` greedy tokens (ignore_eos);
tok/s = B·(new−1) / (time from every request's first token to the last one finishing), as
bench/gpu.py counts it. Needs two GPUs for every layout but TP=1 (those are skipped with one).
Writes tp_gpu.json and tp_gpu.md to --out (default $OUT or the current directory).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from datetime import date
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines

from bench.gpu import PROMPT_LEN, decode_rate  # noqa: E402
from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from worker.engine import Engine  # noqa: E402

MODELS = {"dense": ROOT / "bench" / "models" / "qwen3-8b-shape",
          "moe": ROOT / "bench" / "models" / "qwen3-30b-a3b-shape"}
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 4096
# name → (tp, dp, ep, decode graphs, overlapped decode)
LAYOUTS = {
    "dense": {"TP=1": (1, 1, 1, True, True), "TP=1 plain steps": (1, 1, 1, True, False),
              "TP=2 graphs": (2, 1, 1, True, False), "TP=2 eager": (2, 1, 1, False, False)},
    "moe": {"one GPU": (1, 1, 1, True, True), "DP=2 x EP=2 graphs": (1, 2, 2, True, False),
            "DP=2 x EP=2 eager": (1, 2, 2, False, False)},
}


def engine(model: Path, tp: int, dp: int, ep: int, graphs: bool, overlap: bool,
           new_tokens: int) -> Engine:
    config = WorkerConfig(
        model=ModelConfig(path=str(model), load_format="dummy", max_model_len=MAX_MODEL_LEN,
                          enforce_eager=not graphs),
        cache=CacheConfig(page_size=16, max_total_tokens=MAX_NUM_SEQS * (PROMPT_LEN + new_tokens)
                          + 4096),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, chunked_prefill_size=8192,
                                  overlap="auto" if overlap else "off"),
        parallel=ParallelConfig(device="cuda", tp_size=tp, dp_size=dp, ep_size=ep),
    )
    eng = Engine(config)
    eng.warm_up()  # captures the decode graphs on every rank unless enforce_eager
    return eng


def run_layout(section: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    tp, dp, ep, graphs, overlap = LAYOUTS[section][name]
    t0 = time.perf_counter()
    eng = engine(MODELS[section], tp, dp, ep, graphs, overlap, args.new_tokens)
    out: dict[str, Any] = {"start_s": round(time.perf_counter() - t0, 1)}
    try:
        for b in args.batches:
            out[f"b{b}_tok_s"] = round(decode_rate(eng, b, args.new_tokens, seed=b), 1)
            print(f"[tp_gpu] {section} {name} batch {b}: {out[f'b{b}_tok_s']} tok/s", flush=True)
        captured = eng.dp.graphs if eng.dp is not None else eng.runner.decode_graphs
        out["graph_replays"] = captured.num_replays if captured is not None else 0
    finally:
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return out


def table(r: dict[str, Any]) -> str:
    lines = [f"### decode tok/s on {r['machine']} ({r['date']})", ""]
    batches = r["batches"]
    for section in ("dense", "moe"):
        rows = r.get(section)
        if not rows:
            continue
        lines += [f"{section}: {MODELS[section].name}, {PROMPT_LEN}-token prompts, "
                  f"{r['new_tokens']} new tokens", "",
                  "| layout | " + " | ".join(f"batch {b}" for b in batches) + " | start s |",
                  "|---|" + "---|" * (len(batches) + 1)]
        for name, v in rows.items():
            cells = [str(v.get(f"b{b}_tok_s", "failed" if "error" in v else "-")) for b in batches]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {v.get('start_s', '-')} |")
        lines += [""] + [f"{name}: {v['error'].strip().splitlines()[-1]}"
                         for name, v in rows.items() if "error" in v] + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="dense,moe")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    result: dict[str, Any] = {"date": str(date.today()), "batches": args.batches,
                              "new_tokens": args.new_tokens,
                              "machine": f"{gpus}x {torch.cuda.get_device_name(0)}"}
    for section in args.sections.split(","):
        result[section] = {}
        for name, (tp, dp, _, _, _) in LAYOUTS[section].items():
            if tp * dp > gpus:
                result[section][name] = {"error": f"needs {tp * dp} GPUs"}
                continue
            try:
                result[section][name] = run_layout(section, name, args)
            except Exception:
                result[section][name] = {"error": traceback.format_exc()[-1500:]}
                print(result[section][name]["error"], flush=True)
            (args.out / "tp_gpu.json").write_text(json.dumps(result, indent=1))
            (args.out / "tp_gpu.md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":  # spawned ranks re-import this module
    main()
