"""The clusters of bench/gpu_pd.py: the word-level model, starting clusters at once, where
each cluster's workers go (`--placement`), and the 1P1D workers' KV counters.

Split from bench/gpu_pd.py (the run and its report) so each file holds one idea.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from orchestrator.launch.background import Cluster, running_cluster


def word_level_model(shape: Path, dst: Path, num_layers: int) -> Path:
    """The shape's config with a tokenizer that names every id ("w<id>")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((shape / "config.json").read_text())
    if num_layers:
        config["num_hidden_layers"] = config["max_window_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(shape / "generation_config.json", dst / "generation_config.json")
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"eos_token": None, "bos_token": None}))
    return dst


@contextlib.contextmanager
def clusters_at_once(
    runs: dict[str, tuple[str, list[str]]], tmp: Path, model: Path, ready_timeout_s: float
) -> Iterator[dict[str, Cluster]]:
    """Start every cluster in parallel (slow starts overlap), stop them all on exit."""
    stack = contextlib.ExitStack()
    up: dict[str, Cluster] = {}
    errors: dict[str, BaseException] = {}

    def start(name: str, config: str, sets: list[str]) -> None:
        (tmp / name).mkdir()
        try:
            up[name] = stack.enter_context(
                running_cluster(
                    config, *sets, tmp=tmp / name, model=model, ready_timeout_s=ready_timeout_s
                )
            )
        except BaseException as e:  # reported by the main thread below
            errors[name] = e

    with stack:
        threads = [threading.Thread(target=start, args=(n, c, s)) for n, (c, s) in runs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("; ".join(f"{n}: {e}" for n, e in errors.items()))
        yield up


def transfer_snapshot(c: Cluster) -> dict[str, float]:
    """The 1P1D workers' KV counters (GetLoad) and the decode rooms' time (the gateway's
    histogram)."""
    loads = {name: c.load(name) for name in c.workers}
    text = httpx.get(f"{c.url}/metrics", timeout=10).text

    def metric(name: str) -> float:
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {
        "sent": loads["prefill-0"].transfer_bytes,
        "received": loads["decode-0"].transfer_bytes,
        "pages": loads["decode-0"].transfer_pages,
        "rooms": metric("tandem_kv_transfer_duration_seconds_count"),
        "room_s": metric("tandem_kv_transfer_duration_seconds_sum"),
    }


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in after}
    rooms = int(d["rooms"])
    return {
        "prefill_sent_bytes": int(d["sent"]),
        "decode_received_bytes": int(d["received"]),
        "pages": int(d["pages"]),
        "rooms": rooms,
        # decode's room time runs from its registration to the last page landing, so it holds
        # prefill's queueing and compute too: bytes / this time is a floor on the copy rate
        "room_ms_mean": round(d["room_s"] / rooms * 1e3, 2) if rooms else 0.0,
        "bytes_per_room_time_GBps": round(d["sent"] / d["room_s"] / 1e9, 3) if d["room_s"] else 0.0,
    }


def placements(
    args: argparse.Namespace, common: list[str], device: str
) -> dict[str, tuple[str, list[str]]]:
    """The two clusters of `--placement`: cluster name -> (config, --set overrides)."""
    pd = [*common, f"transfer.backend={args.backend}"]
    if args.placement == "two-gpus":
        return {
            "DP=2 mono": (
                "configs/tiny-mono.yaml",
                [*common, "roles.both.parallel.device=cuda", "roles.both.parallel.dp_size=2"],
            ),
            "1P1D": (
                "configs/tiny-1p1d.yaml",
                [
                    *pd,
                    "roles.prefill.parallel.device=cuda:0",
                    "roles.decode.parallel.device=cuda:1",
                ],
            ),
        }
    return {
        "mono": ("configs/tiny-mono.yaml", [*common, f"roles.both.parallel.device={device}"]),
        "1P1D": (
            "configs/tiny-1p1d.yaml",
            [
                *pd,
                f"roles.prefill.parallel.device={device}",
                f"roles.decode.parallel.device={device}",
            ],
        ),
    }
