"""Speculative decoding on this CPU, every method in one run: decode tok/s and acceptance.

    python -m bench.spec [--prompts arith|agents] [--requests 16] [--k 3] [--threads 1]
                         [--json out.json]

The embedded model in-process (worker.engine.Engine, no gateway), greedy, each answer to its
eos: arith prompts (`--prompts arith`, the default: answers of ~11 tokens), or the model's chat
formats (`agents`: thinking, lookup tool calls and the answers after tool results, rendered by
its chat template as models/eagle_prompts.py draws them; answers of 10-100 tokens with the
added tokens <think>, <tool_call>, ... among them). For each method (off, ngram, eagle, mtp,
draft) and batch size 1 (requests one after another) and 16 (all at once): the output tokens
per second of the decode phase (from the step where every request of the batch holds its first
token to the end, so the prompt's prefill is not in it), the mean accepted length (tokens a
request emits per verify step: accepted drafts + 1; 1.0 without speculation) and the acceptance
rate (accepted / drafted). The outputs of every method must equal speculation-off's, token for
token (checked).

Time is this process's CPU time (`time.process_time`, torch on one thread), the best of
`--rounds` rounds with the methods interleaved: on a CPU shared with other busy processes wall
time measures the neighbours more than the engine (the wall-clock figures are kept in --json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path
from typing import Any

from gateway.tokenizer import Tokenizer
from orchestrator.launch.background import EMBEDDED_MODEL
from orchestrator.tasks import arith
from worker.config import ModelConfig, SchedulerConfig, SpeculativeConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.sampling import SamplingParams

METHODS = ("none", "ngram", "eagle", "mtp", "draft")


def run_batch(engine: Engine, prompts: list[list[int]], tag: str,
              max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Run prompts together; returns outputs and the decode phase's CPU and wall seconds."""
    outs: dict[str, list[int]] = {}

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.token_ids)

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.submit(Request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens)),
                      sink)
    cpu0 = wall0 = None
    while engine.step() or engine.has_pending_work():
        if cpu0 is None and all(outs.get(r) for r in ids):  # every request holds a token
            cpu0, wall0 = time.process_time(), time.perf_counter()
    cpu, wall = time.process_time(), time.perf_counter()
    return [outs[r] for r in ids], cpu - (cpu0 or cpu), wall - (wall0 or wall)


def make_prompts(kind: str, n: int, seed: int) -> tuple[list[list[int]], int]:
    """The bench's prompts as token ids, and the max_tokens that lets every answer reach eos."""
    if kind == "arith":
        tok = Tokenizer.from_dir(Path(EMBEDDED_MODEL))
        return [tok.encode(q.prompt) for q in arith.make_problems(n, seed=seed)], 32
    import random

    from transformers import AutoTokenizer

    from models.eagle_prompts import Format, render

    hf_tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    rng = random.Random(seed)  # below arith.TRAIN_SEED_MIN: no prompt the heads trained on
    formats = [f for f in Format if f is not Format.RAW]
    texts = [render(hf_tok, rng, formats[i % len(formats)]) for i in range(n)]
    return [hf_tok(t, add_special_tokens=False)["input_ids"] for t in texts], 160


def engine_for(method: str, k: int, threads: int) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)  # type: ignore[arg-type]
    engine = Engine(WorkerConfig(model=ModelConfig(path=str(EMBEDDED_MODEL)), speculative=spec,
                                 scheduler=SchedulerConfig(max_num_seqs=16), num_threads=threads))
    engine.warm_up()
    return engine


def measure(engine: Engine, prompts: list[list[int]], batch: int,
            max_tokens: int) -> dict[str, Any]:
    """One round at one batch size: figures and the outputs."""
    engine.spec_counters.reset()
    tokens, cpu, wall = 0, 0.0, 0.0
    got: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        outs, c_s, w_s = run_batch(engine, prompts[start : start + batch], f"b{batch}-{start}",
                                   max_tokens)
        got += outs
        tokens += sum(len(o) - 1 for o in outs)  # the first token is the prefill's
        cpu += c_s
        wall += w_s
    c = engine.spec_counters
    return {
        "decode_tok_s": tokens / cpu, "decode_tok_s_wall": tokens / wall,
        "mean_accepted_length": (c.accepted + c.request_steps) / c.request_steps
        if c.request_steps else 1.0,
        "acceptance": c.accepted / c.drafted if c.drafted else 0.0, "outputs": got,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", choices=("arith", "agents"), default="arith")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--k", type=int, default=3, help="speculative.num_speculative_tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU)")
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--rounds", type=int, default=3, help="best of, methods interleaved")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    prompts, max_tokens = make_prompts(args.prompts, args.requests, args.seed)
    engines = {m: engine_for(m, args.k, args.threads) for m in METHODS}
    results: list[dict[str, Any]] = [{"method": m} for m in METHODS]
    lossless = True
    plain: dict[int, list[list[int]]] = {}  # speculation off's outputs per batch size
    for _ in range(args.rounds):
        for r in results:  # "none" first: its outputs are the reference
            for batch in (1, len(prompts)):
                got = measure(engines[r["method"]], prompts, batch, max_tokens)
                outputs = got.pop("outputs")
                lossless &= plain.setdefault(batch, outputs) == outputs
                best = r.get(f"b{batch}")
                if best is None or got["decode_tok_s"] > best["decode_tok_s"]:
                    r[f"b{batch}"] = got
    for engine in engines.values():
        engine.scheduler.assert_drained()
    load = os.getloadavg()[0]
    print(f"# bench.spec {date.today()}: {platform.machine()} {os.cpu_count()} CPUs, load "
          f"{load:.1f}, torch threads {args.threads}, k={args.k}, {args.requests} "
          f"{args.prompts} prompts, greedy to eos; outputs equal speculation off: {lossless}")
    print("| method | b=1 tok/s | b=1 accepted length | b=16 tok/s | b=16 accepted length | "
          "acceptance |")
    print("|---|---|---|---|---|---|")
    base = results[0]
    for r in results:
        b1, b16 = r["b1"], r[f"b{args.requests}"]
        print(f"| {r['method']} | {b1['decode_tok_s']:.0f} "
              f"({b1['decode_tok_s'] / base['b1']['decode_tok_s']:.2f}x) | "
              f"{b1['mean_accepted_length']:.2f} | {b16['decode_tok_s']:.0f} "
              f"({b16['decode_tok_s'] / base[f'b{args.requests}']['decode_tok_s']:.2f}x) | "
              f"{b16['mean_accepted_length']:.2f} | {b16['acceptance']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"k": args.k, "prompts": args.prompts,
                                         "date": str(date.today()), "load_average": load,
                                         "results": results, "lossless": lossless},
                                        indent=2) + "\n")
    return 0 if lossless else 1


if __name__ == "__main__":
    raise SystemExit(main())
