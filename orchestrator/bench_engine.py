"""Served / engine: what a cluster's clients receive against what its engine makes alone.

    tandem bench --config configs/tiny-mono.yaml --concurrency 4,16 --input-len 32 --output-len 32

For each concurrency B (a list sweeps), with the same requests (the bench's prompts as token
ids, greedy, ignore_eos):
1. the engine in this process (worker/engine.py: no gRPC, gateway or HTTP) at max_num_seqs = B,
   after a warm pass of B short requests: its output tok/s over the run, its decode rate
   (`engine_rates`) and its ITL;
2. the config's cluster, started in the background as `tandem serve` runs it (after the
   engine has given its memory back), under the bench's closed loop of B: output tok/s, ITL.
It prints served / engine: a mono cluster against the engine's whole rate, a PD cluster against
its decode rate (a decode worker only decodes); and served decode / engine decode, the two
rates over the same window (the first B requests all decoding, no prompt running: see
orchestrator/bench_stats.py), which measures a PD decode worker's own rate even where its
prefill worker shares the GPU. The engine of a PD config is the decode role's
worker as role `both`. `--out DIR` writes served_engine.json, served_engine.md and
served_engine.png. bench/served.py measures mono and 1P1D side by side on the GPU.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from orchestrator.bench import BenchSpec, load, make_sessions, summarize
from orchestrator.bench_stats import latency_ms, percentile, token_latencies
from orchestrator.config import ClusterConfig, load_config
from orchestrator.launch.background import ClusterStartError, free_ports, running_cluster
from orchestrator.launch.local import prepare_launch
from orchestrator.worker_config import worker_config
from worker.config import WorkerConfig

# One step of the engine's timed run: (overlapped, seconds, prompt tokens it computed).
Step = tuple[bool, float, int]


class BenchEngineError(ValueError):
    """A served/engine run that cannot measure what it says; the message names the flag."""


def engine_config(cluster: ClusterConfig) -> WorkerConfig:
    """The worker the engine runs as: the mono role, or a PD config's decode role as `both`."""
    if not cluster.roles.is_pd:
        return worker_config(cluster, "both")
    return dataclasses.replace(worker_config(cluster, "decode"), role="both")


def engine_rates(config: WorkerConfig, work: list[tuple[list[int], int]],
                 trace: tuple[int, Path] | None = None) -> dict[str, Any]:
    """The in-process engine over `work` ((prompt ids, output tokens) per request) at the
    config's max_num_seqs (B), all submitted at once as a closed loop of B keeps them queued.
    `trace` = (N, dir): torch.profiler over N steps from step 150 on (device_steps.txt there)."""
    import torch

    from worker.engine import Engine, RequestOutput
    from worker.request import Request
    from worker.sampling import SamplingParams

    batch = config.scheduler.max_num_seqs
    engine = Engine(config)
    engine.warm_up()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    later: list[tuple[float, int]] = []  # (time, tokens) of every output after a first token
    arrivals: dict[str, list[tuple[float, int]]] = {}  # per request, as a client reads them

    def sink(out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids:
            arrivals.setdefault(out.request_id, []).append((now, len(out.token_ids)))
            new_request = out.request_id not in first
            first.setdefault(out.request_id, now)
            later.append((now, len(out.token_ids) - new_request))
        if out.finished:
            done[out.request_id] = now

    # A warm load first, as the served clusters get one: the mixed steps' kernels (Triton
    # compiles each new specialization on first use) are compiled before the clock starts.
    # Reversed prompts: the same shapes, and no prefix-cache hit for the timed run.
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, (p, _) in enumerate(work[:batch]):
        engine.submit(Request(f"w{i}", p[::-1], warm), sink)
    while len(done) < min(batch, len(work)):
        engine.step()
    for seen in (first, done, arrivals):
        seen.clear()
    later.clear()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(work):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.submit(Request(f"e{i}", list(p), params), sink)
    steps: list[Step] = []
    sched = engine.scheduler
    window = range(150, 150 + trace[0]) if trace else range(0)
    prof = torch.profiler.profile() if trace else None
    while len(done) < len(work):
        if prof is not None and len(steps) in (window.start, window.stop):
            prof.start() if len(steps) == window.start else prof.stop()
        before, t = engine.num_overlapped_steps, time.perf_counter()
        prompt_before = sched.prompt_tokens_computed
        with torch.profiler.record_function("tandem_step"):
            engine.step()
        steps.append((engine.num_overlapped_steps > before, time.perf_counter() - t,
                      sched.prompt_tokens_computed - prompt_before))
    wall = time.perf_counter() - t0
    if prof is not None and trace is not None and len(steps) >= window.stop:
        device_steps(prof, steps[window.start : window.stop], trace[1])
    # The decode rate: while every request of the first wave (the first B, admitted together)
    # has its first token and none has finished, every step is a decode at batch B.
    wave = [f"e{i}" for i in range(min(batch, len(work)))]
    t_from, t_to = max(first[r] for r in wave), min(done[r] for r in wave)
    decode_tokens = sum(n for t, n in later if t_from < t <= t_to)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    itl = [x for a in arrivals.values() for x in token_latencies(a[0][0], a)[1]]
    return {"output_tok_s": round(sum(n for _, n in work) / wall, 1),
            "decode_tok_s": round(decode_tokens / max(t_to - t_from, 1e-9), 1),
            "itl_ms": latency_ms(itl), "steps": step_times(steps)}


def device_steps(prof: Any, steps: list[Step], out: Path) -> None:
    """Each profiled step's kernel time (its launches' device time) beside its wall time, by
    kind, and the kernels that took the most device time, into out/device_steps.txt."""
    marks = sorted((e for e in prof.events() if e.name == "tandem_step"),
                   key=lambda e: e.time_range.start)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for (overlapped, seconds, prompt), mark in zip(steps, marks, strict=False):
        kind = ("mixed" if prompt else "decode") + ("" if overlapped else " (plain)")
        kinds.setdefault(kind, []).append((seconds * 1e3, mark.device_time_total / 1e3))
    lines = [f"{len(marks)} profiled steps (wall: the step call; device: its launches' kernels)"]
    for kind, rows in kinds.items():
        walls, devs = [w for w, _ in rows], [d for _, d in rows]
        lines.append(f"{kind}: n={len(rows)} wall p50 {percentile(walls, 50):.2f} ms, device "
                     f"p50 {percentile(devs, 50):.2f} ms, mean {sum(devs) / len(devs):.2f} ms")
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    (out / "device_steps.txt").write_text("\n".join(lines) + "\n\n" + table)
    print("\n".join(lines), flush=True)


def step_times(steps: list[Step]) -> dict[str, Any]:
    """The timed run's engine steps by what they ran, each kind's count and p50 / p99 in ms:
    decodes (no prompt token) and mixed steps (decodes and prompt chunks), those also by how
    many prompt tokens they ran, which shows whether a mixed step costs its prompts' compute or
    a fixed price; `plain` counts the steps that were not overlapped. An overlapped step's call
    returns once the in-flight step before it is done on the device, so its time is that step's
    (filed under that step's kind; none after a plain step); a plain step's call runs it to
    the end."""
    kinds: dict[str, list[float]] = {"decode": [], "mixed": []}
    edges = (0, 64, 128, 256, 512)
    for i, (overlapped, seconds, prompt) in enumerate(steps):
        if overlapped:  # it waited for the step before it, if that one was in flight too
            if i == 0 or not steps[i - 1][0]:
                continue
            prompt = steps[i - 1][2]
        kinds["mixed" if prompt else "decode"].append(seconds * 1e3)
        if prompt:
            lo = max((e for e in edges if e < prompt), default=-1)
            hi = min((e for e in edges if e >= prompt), default=None)
            name = f"mixed {lo + 1}-{hi}" if hi is not None else f"mixed >{edges[-1]}"
            kinds.setdefault(name, []).append(seconds * 1e3)
    out = {kind: {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2),
                  "p99_ms": round(percentile(ms, 99), 2)} for kind, ms in kinds.items()}
    out["plain"] = {"n": sum(not overlapped for overlapped, _, _ in steps)}
    return out


def work_for(spec: BenchSpec, model_dir: str) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of each request the served run sends: its ids prompts, or
    the model's tokenizer's ids of its text prompts (as the gateway encodes them)."""
    from gateway.tokenizer import Tokenizer

    if spec.dataset != "random":
        raise BenchEngineError(f"--dataset {spec.dataset}: served / engine runs the random "
                               "dataset only (one turn a request, as the engine takes them)")
    sessions = make_sessions(spec)
    prompts = [s.prompt(0, "") for s in sessions]
    if not all(isinstance(p, list) for p in prompts):
        if not (Path(model_dir) / "tokenizer.json").is_file():
            raise BenchEngineError(f"{model_dir} has no tokenizer.json: pass --prompt-kind ids")
        tok = Tokenizer.from_dir(model_dir)
        prompts = [tok.encode(p) for p in prompts]
    return [(p, s.max_tokens) for p, s in zip(prompts, sessions, strict=True)]


def served_vs_engine(config_path: Path, sets: list[str], specs: list[BenchSpec],
                     out: IO[str], err: IO[str], out_dir: Path | None = None) -> dict[str, Any]:
    """Measure every spec (closed loops of B = spec.concurrency) on the engine, then on the
    config's cluster; print the table to `out` and progress to `err`; return the result."""
    cluster = load_config(config_path, sets)
    # The measured cluster is this command's own: free ports for every listener, so it starts
    # beside a cluster already serving the same config (whose ports the file may pin); the
    # gateway's port only where the command line asks for one (--port, --set gateway.port).
    pinned = any(s.partition("=")[0].strip() == "gateway.port" for s in sets)
    port = cluster.gateway.port if pinned else free_ports(1)[0]
    launch_sets = [*sets, *(f"roles.{name}.base_port=0" for name, _ in cluster.roles.present()),
                   "transfer.bootstrap_port=0", f"gateway.port={port}"]
    prepare_launch(load_config(config_path, launch_sets))  # checkpoint, ports: before the engine
    serving = engine_config(cluster)
    most_seqs = serving.scheduler.max_num_seqs
    for spec in specs:
        if spec.concurrency > most_seqs:
            raise BenchEngineError(
                f"--concurrency {spec.concurrency} is above the config's scheduler.max_num_seqs "
                f"({most_seqs}): its workers never run that batch; lower it or --set "
                f"scheduler.max_num_seqs={spec.concurrency}")
    model_dir = cluster.model.path
    specs = [dataclasses.replace(spec, api_key=spec.api_key or cluster.gateway.api_key)
             for spec in specs]
    result: dict[str, Any] = {"config": str(config_path), "sets": sets, "pd": cluster.roles.is_pd,
                              "rows": []}
    works = [work_for(spec, model_dir) for spec in specs]  # refuses what it cannot run, first
    for spec, work in zip(specs, works, strict=True):
        b = spec.concurrency
        sized = dataclasses.replace(
            serving, scheduler=dataclasses.replace(serving.scheduler, max_num_seqs=b))
        print(f"[bench] engine in-process, B={b}", file=err, flush=True)
        result["rows"].append({"b": b, "engine": engine_rates(sized, work)})
    timeout = cluster.launcher.ready_timeout_s
    warm = dataclasses.replace(specs[0], input_len=16, output_len=4, num_requests=8,
                               concurrency=8, range_ratio=0.0)
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp, running_cluster(
            str(config_path), *launch_sets, f"launcher.ready_timeout_s={timeout}", tmp=Path(tmp),
            model=Path(model_dir), ready_timeout_s=timeout + 30, port=port,
            admin_key=cluster.gateway.admin_key,
        ) as up:
            print(f"[bench] cluster up at {up.url}", file=err, flush=True)
            load(up.url, warm)
            for spec, row in zip(specs, result["rows"], strict=True):
                print(f"[bench] served, concurrency {spec.concurrency}", file=err, flush=True)
                row["served"] = summarize(*load(up.url, spec), spec)
    except ClusterStartError as exc:
        raise BenchEngineError(f"the cluster did not start: {exc.first_error()}") from None
    out.write(table(result, specs[0]))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "served_engine.json").write_text(json.dumps(result, indent=1))
        (out_dir / "served_engine.md").write_text(table(result, specs[0]))
        plot(result, out_dir / "served_engine.png")
    return result


def ratio(row: dict[str, Any], pd: bool) -> float:
    """served / engine: against the engine's decode rate for PD, its whole rate for mono."""
    ref = row["engine"]["decode_tok_s" if pd else "output_tok_s"]
    return float(row["served"]["output_throughput"]) / ref if ref else 0.0


def decode_ratio(row: dict[str, Any]) -> float | None:
    """served decode / engine decode: the two rates at batch B over the same window (the first
    wave's, bench_stats.wave_decode_rate); None when the served run had no such window."""
    served, ref = row["served"].get("decode_throughput"), row["engine"]["decode_tok_s"]
    return float(served) / ref if served is not None and ref else None


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(result: dict[str, Any], spec: BenchSpec) -> str:
    kind, ref = ("PD", "engine decode") if result["pd"] else ("mono", "engine")
    lines = [f"served / engine: {result['config']}"
             + "".join(f" --set {s}" for s in result["sets"])
             + f" ({kind}); {spec.input_len} in / {spec.output_len} out, {spec.num_requests} "
             "requests a point; the engine in-process at max_num_seqs B", "",
             "| B | engine tok/s | engine decode tok/s | engine ITL p50 / p99 ms | served tok/s | "
             f"served / {ref} | served decode tok/s | served decode / engine decode | "
             "served ITL p50 / p99 ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        e, s = row["engine"], row["served"]
        lines.append(f"| {row['b']} | {e['output_tok_s']} | {e['decode_tok_s']} | "
                     f"{e['itl_ms']['p50']:.2f} / {e['itl_ms']['p99']:.2f} | "
                     f"{s['output_throughput']:.1f} | {ratio(row, result['pd']):.2f} | "
                     f"{_cell(s.get('decode_throughput'), '.1f')} | "
                     f"{_cell(decode_ratio(row), '.2f')} | "
                     f"{s['itl_ms']['p50']:.2f} / {s['itl_ms']['p99']:.2f} | {s['failed']} |")
    return "\n".join(lines) + "\n" + (
        "\nserved decode: output tok/s while the first B requests all decode and none has "
        "finished (no prompt runs then), the window of the engine's decode rate\n")


def plot(result: dict[str, Any], path: Path) -> None:
    """Output tok/s by B (engine, engine decode, served) and served / engine beside it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    bs = [row["b"] for row in result["rows"]]
    fig, (rate, share) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, values in (
        ("engine", [row["engine"]["output_tok_s"] for row in result["rows"]]),
        ("engine decode", [row["engine"]["decode_tok_s"] for row in result["rows"]]),
        ("served", [row["served"]["output_throughput"] for row in result["rows"]]),
        ("served decode", [row["served"].get("decode_throughput") or float("nan")
                           for row in result["rows"]]),
    ):
        rate.plot(bs, values, "o-", label=label)
    ratios = [ratio(row, result["pd"]) for row in result["rows"]]
    decode = [decode_ratio(row) or float("nan") for row in result["rows"]]
    share.plot(bs, ratios, "o-", label="served / engine" + (" decode" if result["pd"] else ""))
    share.plot(bs, decode, "s--", label="served decode / engine decode")
    share.legend(fontsize=8)
    share.axhline(1.0, color="grey", lw=0.8)
    top = max(1.2, *ratios, *(r for r in decode if r == r))  # nan (no window) is not r
    share.set_ylim(0, top * 1.05)  # from 0: a 2% gap stays small
    rate.set_ylabel("output tokens/s")
    share.set_ylabel("served / engine")
    for ax in (rate, share):
        ax.set_xlabel("concurrency = engine batch B")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    rate.legend(fontsize=8)
    fig.suptitle(f"served / engine: {Path(result['config']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
