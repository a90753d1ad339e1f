"""Speculative decoding on one GPU: what a verify step costs, and the speed-up it buys.

    python3 -m bench.spec_gpu [--acceptance spec-cpu.json] [--methods eagle,draft]
        [--batches 1] [--out DIR]

At the qwen3-8b shape (bench/models/qwen3-8b-shape, dummy weights, bf16, Triton attention,
CUDA graphs for decode and verify steps, and for a model drafter's draft steps), with
512-token prompts, at batch 1 and 16:

1. ms per step of a plain decode step and of a verify step scoring k = 1..8 drafts per request
   (one forward over k + 1 tokens each, acceptance included): the verify's cost over decode's.
2. ms per step of each method's drafting at k: ngram (the host lookup over 512-token
   histories), eagle (an EAGLE head of the 8B shape, bench/models/qwen3-8b-shape/eagle: k - 1
   head steps and k LM-head rows, plus the catch-up over the verified tokens), mtp (the same for
   an MTP module of that size in DeepSeek-V3's layout, .../mtp), draft (a model
   of Qwen3-0.6B's shape, .../draft: k steps; its catch-up over the verified tokens too).
3. The decode speed-up at each method's measured acceptance rate a (accepted / drafted, from
   bench/spec.py's --json on the embedded model, or --alpha method=a): tokens per step
   L(k) = (1 - a^(k+1)) / (1 - a) (independent acceptance per draft, Leviathan et al.) over
   the step's time (verify(k) + draft(k)), against plain decode's 1 / decode_step; the best k.
   The issue's goal: >= 2x decode tok/s at batch 1 where L >= 3.

Prints markdown tables and writes spec_gpu.json to --out (default $OUT or .), and
spec_speedup.png there where matplotlib is installed (`--plot-only DIR` draws it from DIR's
spec_gpu.json afterwards): speed-up against k per method and batch, and the verify step's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Engine  # noqa: E402
from worker.request import Request  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402
from worker.spec.drafter import ModelDrafter  # noqa: E402
from worker.step import RunOutput, SchedulePlan  # noqa: E402
from worker.verify_graphs import VerifyGraphs  # noqa: E402

MODEL = ROOT / "bench" / "models" / "qwen3-8b-shape"
PROMPT_LEN, MAX_K, BATCHES = 512, 8, (1, 16)
MAX_MODEL_LEN = 2048


def engine_for(method: str, model: Path, device: str) -> Engine:
    dummy = model == MODEL
    cfg = WorkerConfig(
        model=ModelConfig(path=str(model), load_format="dummy" if dummy else "auto",
                          dtype="bfloat16" if dummy else "auto",
                          max_model_len=MAX_MODEL_LEN if dummy else 0),
        cache=CacheConfig(page_size=16, num_pages=16 * (MAX_MODEL_LEN // 16) + 64),
        scheduler=SchedulerConfig(max_num_seqs=16, chunked_prefill_size=8192),
        parallel=ParallelConfig(device=device),
        speculative=SpeculativeConfig(method=method,  # type: ignore[arg-type]
                                      num_speculative_tokens=MAX_K),
    )
    engine = Engine(cfg)
    engine.warm_up()  # decode graphs (and verify graphs at k = MAX_K)
    return engine


def prefill(engine: Engine, batch: int, prompt_len: int) -> None:
    """`batch` requests with prompts of `prompt_len` tokens, each to its first token."""
    rng = random.Random(batch)
    vocab = engine.spec.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(vocab // 100, vocab - 10) for _ in range(prompt_len)]
        engine.scheduler.add(Request(f"r{batch}-{i}", prompt,
                                     SamplingParams(temperature=0.0, max_tokens=1000,
                                                    ignore_eos=True)))
    sched = engine.scheduler
    while sched.waiting or any(not r.output_token_ids for r in sched.running):
        plan = sched.schedule()
        sched.update(plan, engine.runner.run(plan))


def verify_plan(engine: Engine, k: int) -> SchedulePlan:
    """The running batch's next step with k random drafts each (pages reserved for them)."""
    engine.scheduler.num_speculative_tokens = k
    plan = engine.scheduler.schedule()
    rng = random.Random(k)
    vocab = engine.spec.vocab_size
    for c in plan.chunks:
        c.drafts = [rng.randrange(vocab // 100, vocab - 10) for _ in range(c.max_drafts)]
        c.num_tokens += len(c.drafts)
        plan.num_tokens += len(c.drafts)
    return plan


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn: Any, iters: int = 20) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters * 1e3


def step_costs(engine: Engine, batch: int) -> dict[str, Any]:
    """decode ms and verify ms for k = 1..MAX_K (graphs captured per k)."""
    runner = engine.runner
    out: dict[str, Any] = {}
    plan = verify_plan(engine, 0)  # forward + sampling (a drafter's catch-up is timed apart)
    out["decode_ms"] = wall_ms(lambda: runner.sample(plan, runner.forward_hidden(plan)[1]))
    cuda = engine.device.type == "cuda"
    for k in range(1, MAX_K + 1):
        graphs = VerifyGraphs(engine.model, engine.kv, 16, engine.max_model_len, k)
        if cuda:  # (a CPU smoke run, --device cpu, times the eager verify instead)
            graphs.capture()
            runner.verify_graphs = graphs
        plan = verify_plan(engine, k)

        def verify(plan: SchedulePlan = plan) -> None:
            runner.sample(plan, runner.forward_hidden(plan)[1])

        out[f"verify_ms_k{k}"] = wall_ms(verify)
        assert graphs.num_replays > 0 or not cuda
    return out


def draft_costs(engine: Engine, method: str) -> dict[str, float]:
    """ms per step of drafting k tokens (and a model drafter's catch-up) for k = 1..MAX_K."""
    drafter = engine.drafter
    assert drafter is not None
    out: dict[str, float] = {}
    for k in range(1, MAX_K + 1):
        def draft(k: int = k) -> None:
            engine.scheduler.num_speculative_tokens = k
            plan = engine.scheduler.schedule()
            drafter.draft(plan)

        out[f"draft_ms_k{k}"] = wall_ms(draft)
        if isinstance(drafter, ModelDrafter):  # catch-up over k/2 accepted + 1 per request
            plan = verify_plan(engine, k)
            hidden, _ = engine.runner.forward_hidden(plan)
            accepted = [c.drafts[: k // 2] for c in plan.chunks]
            fake = RunOutput(token_ids=[a[0] if a else 5 for a in accepted],
                             logprobs=[None] * len(accepted),
                             more_token_ids=[a[1:] + [5] if a else [] for a in accepted])
            states = [c.request.draft for c in plan.chunks]  # catch-up moves them on
            def catch_up(p: SchedulePlan = plan, h: torch.Tensor = hidden,
                         f: RunOutput = fake) -> None:
                drafter.catch_up(p, h, f)  # type: ignore[union-attr]

            out[f"catch_up_ms_k{k}"] = wall_ms(catch_up)
            for c, state in zip(plan.chunks, states, strict=True):
                c.request.draft = state
    return out


def speedups(costs: dict[str, Any], alpha: dict[str, float],
             batches: tuple[int, ...] = BATCHES) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for method, a in alpha.items():
        for b in batches:
            c = costs[method][f"b{b}"]
            best = (0.0, 0)
            row = {}
            for k in range(1, MAX_K + 1):
                tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
                step = (c[f"verify_ms_k{k}"] + c.get(f"draft_ms_k{k}", 0.0)
                        + c.get(f"catch_up_ms_k{k}", 0.0))
                s = tokens * c["decode_ms"] / step
                row[f"k{k}"] = {"tokens_per_step": tokens, "speedup": s}
                best = max(best, (s, k))
            result[f"{method}_b{b}"] = {"alpha": a, "per_k": row, "best_k": best[1],
                                        "best_speedup": best[0]}
    return result


def plot(result: dict[str, Any], out: Path) -> Path:
    """spec_speedup.png: decode speed-up against k (one line per method, solid batch 1, dashed
    batch 16), and verify ms / decode ms against k."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = list(range(1, MAX_K + 1))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(result["costs"])
    for method, color in zip(methods, colors, strict=False):
        for b, style in ((1, "-"), (16, "--")):
            s = result["speedups"].get(f"{method}_b{b}")
            if s is None:
                continue
            left.plot(ks, [s["per_k"][f"k{k}"]["speedup"] for k in ks], style, color=color,
                      marker="o", ms=3, label=f"{method} b={b} (a={s['alpha']:.2f})")
    left.axhline(2.0, color="grey", lw=0.8, ls=":")
    left.set(xlabel="drafts per step k", ylabel="decode tok/s vs no speculation",
             title="speed-up at each method's acceptance")
    left.legend(fontsize=7)
    first = result["costs"][methods[0]]
    for b, style in ((1, "-"), (16, "--")):
        c = first.get(f"b{b}")
        if c is not None:
            right.plot(ks, [c[f"verify_ms_k{k}"] / c["decode_ms"] for k in ks], style,
                       color="black", marker="o", ms=3, label=f"b={b}")
    right.set(xlabel="drafts per step k", ylabel="verify ms / decode ms",
              title="a verify step's cost")
    right.legend(fontsize=7)
    fig.suptitle(f"bench.spec_gpu on {result['device']}")
    fig.tight_layout()
    path = out / "spec_speedup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--acceptance", type=Path, help="bench/spec.py --json output")
    p.add_argument("--alpha", action="append", default=[], help="method=rate overrides")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--model", type=Path, default=MODEL,
                   help="the 8B shape (dummy); another directory: its real weights and drafters")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--methods", default="ngram,eagle,mtp,draft", help="comma-separated subset")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="e.g. 1 or 1,16")
    p.add_argument("--plot-only", type=Path, metavar="DIR",
                   help="draw spec_speedup.png from DIR/spec_gpu.json, nothing else")
    args = p.parse_args(argv)
    if args.plot_only:
        print(plot(json.loads((args.plot_only / "spec_gpu.json").read_text()), args.plot_only))
        return 0
    methods = args.methods.split(",")
    if set(methods) - {"ngram", "eagle", "mtp", "draft"}:
        p.error(f"--methods: unknown {sorted(set(methods) - {'ngram', 'eagle', 'mtp', 'draft'})};"
                " pick from ngram,eagle,mtp,draft")
    batches = tuple(int(b) for b in args.batches.split(","))
    alpha: dict[str, float] = {"ngram": 0.5, "eagle": 0.7, "mtp": 0.7, "draft": 0.7}
    if args.acceptance:
        for r in json.loads(args.acceptance.read_text())["results"]:
            if r["method"] in alpha:
                alpha[r["method"]] = r["b16"]["acceptance"]
    for item in args.alpha:
        name, value = item.split("=")
        alpha[name] = float(value)
    costs: dict[str, Any] = {}
    for method in methods:
        engine = engine_for(method, args.model, args.device)
        costs[method] = {}
        for b in batches:
            prefill(engine, b, args.prompt_len)
            costs[method][f"b{b}"] = {**step_costs(engine, b), **draft_costs(engine, method)}
            for req in list(engine.scheduler.running):
                engine.scheduler.abort(req.request_id)
        engine.scheduler.assert_drained()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": name, "costs": costs,
              "speedups": speedups(costs, {m: alpha[m] for m in methods}, batches)}
    print(f"# bench.spec_gpu on {result['device']}: {args.model.name}, prompts "
          f"{args.prompt_len}, CUDA graphs for decode, verify and draft steps")
    c = costs[methods[0]]
    print("| batch | decode ms | " + " | ".join(f"verify k={k}" for k in range(1, MAX_K + 1))
          + " |")
    print("|---|---|" + "---|" * MAX_K)
    for b in batches:
        row = c[f"b{b}"]
        print(f"| {b} | {row['decode_ms']:.2f} | " + " | ".join(
            f"{row[f'verify_ms_k{k}']:.2f} ({row[f'verify_ms_k{k}'] / row['decode_ms']:.2f}x)"
            for k in range(1, MAX_K + 1)) + " |")
    print("\n| method | a | batch | draft ms k=3 | best k | speed-up |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        for b in batches:
            s = result["speedups"][f"{method}_b{b}"]
            d = costs[method][f"b{b}"]
            draft = d.get("draft_ms_k3", 0.0) + d.get("catch_up_ms_k3", 0.0)
            print(f"| {method} | {alpha[method]:.2f} | {b} | {draft:.2f} | {s['best_k']} | "
                  f"{s['best_speedup']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        print(plot(result, args.out))
    except ModuleNotFoundError as exc:  # the GPU machine may lack matplotlib: plot elsewhere
        print(f"no plot ({exc}); run: python -m bench.spec_gpu --plot-only {args.out}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
