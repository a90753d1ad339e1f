"""`tandem bench --out DIR`: the run as JSON and two PNG plots (matplotlib, no display).

- `bench.json`: every load point's summary, plus its raw per-token ITL and per-request TTFT
  samples (for plots of your own).
- `latency_throughput.png`: TTFT and ITL (p50 solid, p99 dashed) against output tokens/s, one
  line per run, a marker per load point labelled with its concurrency or rate.
- `itl_cdf.png`: the per-token ITL distribution of each load point.
`plot_runs` takes several runs (label -> points) so one figure compares clusters
(bench/pd_vs_mono.py: 1P1D vs mono).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(out_dir: Path, points: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps({**meta, "points": points}))  # samples make it long
    return path


def _label(point: dict[str, Any]) -> str:
    return point["mode"].replace("concurrency ", "c=").replace("rate ", "r=")


def plot_runs(runs: dict[str, list[dict[str, Any]]], out_dir: Path, title: str = "") -> list[Path]:
    """Draw the two plots for `runs` (label -> load points with `samples`) into out_dir."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (label, points), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()
                                      ["color"], strict=False):
        xs = [p["output_throughput"] for p in points]
        for ax, key in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
            ax.plot(xs, [p[key]["p50"] for p in points], "o-", color=color, label=f"{label} p50")
            ax.plot(xs, [p[key]["p99"] for p in points], "s--", color=color, alpha=0.7,
                    label=f"{label} p99")
            for x, p in zip(xs, points, strict=True):
                ax.annotate(_label(p), (x, p[key]["p50"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
    for ax, name in zip(axes, ("TTFT", "ITL (per token)"), strict=True):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} ms")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "latency vs throughput")
    fig.tight_layout()
    paths = [out_dir / "latency_throughput.png", out_dir / "itl_cdf.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, points in runs.items():
        for p in points:
            itl = sorted(p.get("samples", {}).get("itl_ms", []))
            if itl:
                ys = [(i + 1) / len(itl) for i in range(len(itl))]
                ax.step(itl, ys, where="post", label=f"{label} {_label(p)}")
    ax.set_xscale("log")
    ax.set_xlabel("ITL ms (per token)")
    ax.set_ylabel("fraction of tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title or "ITL CDF")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths
