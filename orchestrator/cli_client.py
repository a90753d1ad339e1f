"""The `tandem` subcommands that talk to a running server: eval and bench (flags and handlers).

They speak HTTP to an OpenAI-style URL, so they import no worker or gateway code, except
`bench --config` (orchestrator/bench_engine.py), which runs the engine in this process too; the
process-running subcommands stay in orchestrator/cli.py, which adds these to its parser.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchestrator.config import EvalGate, load_config, resolve_config_path

EXIT_USAGE = 2  # bad flags or config, unreachable server
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the eval and bench subcommands to the `tandem` parser's subparsers."""
    gate = EvalGate()
    p = sub.add_parser(
        "eval", help="score a task against a server; non-zero below the bar",
        description="Prints `accuracy: X (k/N)`; exits 1 below --min-accuracy, 2 if the server "
                    "is unreachable. arith: raw prompts through /v1/completions. lookup: the tool "
                    "loop (call, tool result, answer) through /v1/chat/completions.",
    )
    p.add_argument("--url", required=True,
                   help="server URL, e.g. http://127.0.0.1:8000 (or the client base URL, .../v1)")
    p.add_argument("--config", metavar="PATH",
                   help="take the defaults below from this config's eval section")
    p.add_argument("--task", help=f"task family: arith or lookup (default {gate.task})")
    p.add_argument("--samples", type=int, help=f"number of problems (default {gate.samples})")
    p.add_argument("--concurrency", type=int,
                   help=f"requests in flight (default {gate.concurrency})")
    p.add_argument("--min-accuracy", type=float,
                   help=f"the bar, 0..1 (default {gate.min_accuracy}, arith's; the embedded "
                        "model scores 0.82-0.89 on lookup, which its tests gate at 0.7)")
    p.add_argument("--seed", type=int, help=f"problem seed (default {gate.seed})")
    p.add_argument("--enable-thinking", action="store_true",
                   help="tool tasks: send chat_template_kwargs {enable_thinking: true} and require "
                        "reasoning_content in every reply")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default="", help="bearer token, if the server wants one")

    p = sub.add_parser("bench", help="a streaming serving workload against an OpenAI URL, or "
                                     "a config's cluster against its engine in-process",
                       description="With --url: TTFT / TPOT / per-token ITL / E2E percentiles "
                                   "and throughput, for one load point or a sweep; --out DIR "
                                   "adds JSON and plots. With --config: served / engine, the "
                                   "engine in this process at batch B and the config's cluster "
                                   "(started here) at concurrency B, for each B of "
                                   "--concurrency.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="server base URL")
    target.add_argument("--config", metavar="PATH",
                        help="served / engine for this cluster YAML (closed loops, random "
                             "dataset); --out DIR writes served_engine.json/.md/.png")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --config: override one field of it (repeatable)")
    p.add_argument("--port", type=int, metavar="N",
                   help="with --config: the gateway port of the cluster it starts "
                        "(= --set gateway.port=N; default: a free port)")
    p.add_argument("--input-len", type=int, default=128,
                   help="prompt length (characters or token ids)")
    p.add_argument("--output-len", type=int, default=32,
                   help="output tokens per request (ignore_eos)")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests per load point (shared-prefix: num_requests // num_turns "
                        "conversations of num_turns requests, so 63 of 64 with 3 turns; jsonl: "
                        "the file's lines cycled or cut to this many sessions)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", metavar="C[,C...]",
                      help="closed loop: requests in flight (default 4); a list sweeps")
    load.add_argument("--request-rate", metavar="R[,R...]",
                      help="open loop: Poisson arrivals per second; a list sweeps")
    p.add_argument("--dataset", default="random", metavar="random|shared-prefix|jsonl:PATH",
                   help="random prompts; synthetic multi-turn conversations over shared system "
                        "prompts; or a JSONL file of {\"prompt\": text|ids, \"max_tokens\": N}")
    p.add_argument("--num-turns", type=int, default=3, help="shared-prefix: turns per conversation")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: their length")
    p.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                   help="random text, or random token-id lists "
                        "(exact lengths where the server takes ids)")
    p.add_argument("--vocab-size", type=int, default=32, help="ids: draw token ids from [1, N)")
    p.add_argument("--long-every", type=int, default=0, metavar="K",
                   help="mixed load: every K-th request has a --long-input-len prompt")
    p.add_argument("--long-input-len", type=int, default=1024, metavar="M")
    p.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                   help="random: draw each input and output length from [L(1-R), L(1+R)], "
                        "0 <= R < 1 (a steady closed loop rather than waves; vLLM's flag)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=1, metavar="N",
                   help="load-generator processes (default 1: one core parses every stream event; "
                        "give more at high concurrency on a fast server)")
    p.add_argument("--json", action="store_true", help="print JSON (a list for a sweep)")
    p.add_argument("--out", metavar="DIR",
                   help="write bench.json, latency_throughput.png and itl_cdf.png there")
    p.add_argument("--no-token-ids", action="store_true",
                   help="do not send return_token_ids (count one token per stream event)")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default="")


ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def url_problem(url: str | None, flag: str = "--url") -> str:
    """One line when `url` cannot be a server's base URL ("" when it can); `flag` names it."""
    if url is None:
        return ""
    fix = "give one like http://127.0.0.1:8000"
    if not url.startswith(("http://", "https://")):
        return f"error: {flag} {url!r} is not an http(s) URL; {fix}"
    try:  # httpx and anyio raise deep inside a request (a traceback) for these
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port past 65535 or not a number, an unclosed [IPv6
        return f"error: {flag} {url!r}: {exc}; {fix}"
    if not parts.hostname:
        return f"error: {flag} {url!r} names no host; {fix}"
    if port == 0:
        return f"error: {flag} {url!r}: the port must be within 1..65535; {fix}"
    path = parts.path.rstrip("/")
    for endpoint in ENDPOINTS:  # pasted from a curl line: the paths asked for go after the base
        if path.endswith(endpoint):
            base = url[: url.index(parts.netloc) + len(parts.netloc)] + path[: -len(endpoint)]
            return (f"error: {flag} {url!r} names an endpoint, not the server; give its base URL, "
                    f"{base} (or {base}/v1)")
    return ""


def _server_root(url: str | None) -> str | None:
    """The server's root URL: an OpenAI client's base URL (http://host:port/v1) names the same
    server, and the paths asked for (/v1/models, /metrics) are appended to the root."""
    if url is None:
        return None
    root = url.rstrip("/")
    return root[:-3].rstrip("/") if root.endswith("/v1") else root


def cmd_eval(args: argparse.Namespace) -> int:
    return _interruptible("eval", _eval, args)


def cmd_bench(args: argparse.Namespace) -> int:
    return _interruptible("bench", _bench, args)


def _interruptible(name: str, command: Any, args: argparse.Namespace) -> int:
    """Ctrl-C before the command's own handling of it (its modules loading, the server asked
    its model) is one line too."""
    try:
        return int(command(args))
    except KeyboardInterrupt:
        print(f"interrupted: tandem {name} stopped before any request", file=sys.stderr)
        return EXIT_INTERRUPTED


def _eval(args: argparse.Namespace) -> int:
    if problem := url_problem(args.url):
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    args.url = _server_root(args.url)
    from orchestrator.client import ServerError
    from orchestrator.eval import EvalResult, report, run_eval
    from orchestrator.tasks import TaskMode, UnknownTaskError, get_task

    gate = _load_eval_gate(args.config)
    task_name = args.task or gate.task
    samples = args.samples if args.samples is not None else gate.samples
    concurrency = args.concurrency if args.concurrency is not None else gate.concurrency
    bar = args.min_accuracy if args.min_accuracy is not None else gate.min_accuracy
    seed = args.seed if args.seed is not None else gate.seed
    if samples < 1 or concurrency < 1:
        print(f"error: --samples and --concurrency must be >= 1, got {samples} and {concurrency}",
              file=sys.stderr)
        return EXIT_USAGE
    if not 0.0 <= bar <= 1.0:
        print(f"error: --min-accuracy must be within 0..1, got {bar}", file=sys.stderr)
        return EXIT_USAGE
    try:
        task = get_task(task_name)
    except UnknownTaskError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    tool_loop = task.MODE is TaskMode.TOOL_LOOP
    if args.enable_thinking and not tool_loop:
        print(f"error: --enable-thinking needs a chat task (lookup); {task_name} sends raw "
              "completions", file=sys.stderr)
        return EXIT_USAGE
    result = EvalResult(total=samples)  # filled as problems finish
    try:
        if tool_loop:
            from orchestrator.eval_tools import run_tool_eval  # lazy: imports the openai client

            asyncio.run(run_tool_eval(
                args.url, task, samples, concurrency, seed, args.model, args.api_key,
                enable_thinking=args.enable_thinking, result=result,
            ))
        else:
            asyncio.run(run_eval(
                args.url, task, samples, concurrency, seed, args.model, args.api_key,  # type: ignore[arg-type]
                result=result,
            ))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"interrupted: {result.done} of {result.total} problems answered ({result.correct} "
              f"right, {result.failed} failed); no verdict on a part of them", file=sys.stderr)
        return EXIT_INTERRUPTED
    return report(result, bar, sys.stdout, sys.stderr)


def _served_vs_engine(args: argparse.Namespace, specs: list[Any]) -> int:
    """`tandem bench --config`: the engine in-process against the config's cluster."""
    from orchestrator.bench_engine import BenchEngineError, served_vs_engine  # imports torch
    from orchestrator.config_checks import ClusterConfigError
    from worker.arch.hf_config import ModelLoadError
    from worker.config import ConfigError

    if args.request_rate:
        print("error: --request-rate: served / engine measures closed loops; give "
              "--concurrency B[,B...] (the engine's batch B)", file=sys.stderr)
        return EXIT_USAGE
    # --port first, as serve's named flags: a --set of the same key wins
    sets = [*([] if args.port is None else [f"gateway.port={args.port}"]), *args.overrides]
    try:
        result = served_vs_engine(resolve_config_path(args.config), sets, specs,
                                  io.StringIO() if args.json else sys.stdout, sys.stderr,
                                  Path(args.out) if args.out else None)
    except (BenchEngineError, ClusterConfigError, ModelLoadError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)  # ModelLoadError: weights the engine cannot
        return EXIT_USAGE  # load in this process (tensors the launcher's checks do not read)
    except KeyboardInterrupt:  # the cluster, if it was up, stopped on the way out
        print("interrupted: served / engine cut during the step the last [bench] line names; "
              "any cluster it started is stopped; no table"
              + (", nothing written to --out" if args.out else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.json:
        print(json.dumps(result))
    return 0


def _load_eval_gate(config: str | None) -> EvalGate:
    return load_config(resolve_config_path(config)).eval if config else EvalGate()


def _sweep_values(text: str | None, kind: type, flag: str) -> list[Any]:
    """`--concurrency 1,4,16` -> [1, 4, 16]; ValueError names the flag."""
    if text is None:
        return []
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes numbers separated by commas, got {text!r}") from None
    if not values or any(not v > 0 for v in values):  # not > 0: NaN too
        raise ValueError(f"{flag} values must be > 0, got {text!r}")
    return values


def _out_problem(out: str | None) -> str:
    """One line when --out cannot become a directory ("" when it can); checked before the run,
    whose results would otherwise be lost to mkdir's error at the end."""
    if out is None:
        return ""
    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        return f"error: --out {out!r} is not a directory{where}; name a directory for the results"
    return ""


def _bench(args: argparse.Namespace) -> int:
    if problem := url_problem(args.url):
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    args.url = _server_root(args.url)
    from orchestrator.bench import BenchSpec, bench_main
    from orchestrator.bench_data import DatasetError, make_sessions_check

    for name in ("input_len", "output_len", "num_requests", "num_turns", "num_groups",
                 "prefix_len", "clients"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
                  file=sys.stderr)
            return EXIT_USAGE
    if args.long_every < 0:
        print(f"error: --long-every must be >= 0 (0 = no long requests), got {args.long_every}",
              file=sys.stderr)
        return EXIT_USAGE
    if args.long_every and args.long_input_len < 1:
        print(f"error: --long-input-len must be >= 1, got {args.long_input_len}", file=sys.stderr)
        return EXIT_USAGE
    if problem := _out_problem(args.out):
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    if not 0 <= args.range_ratio < 1:
        print(f"error: --range-ratio must be in [0, 1), got {args.range_ratio}", file=sys.stderr)
        return EXIT_USAGE
    if args.vocab_size < 2:
        print(f"error: --vocab-size must be >= 2, got {args.vocab_size}", file=sys.stderr)
        return EXIT_USAGE
    try:
        rates = _sweep_values(args.request_rate, float, "--request-rate")
        concs = _sweep_values(args.concurrency, int, "--concurrency") if not rates else []
        make_sessions_check(args.dataset)
    except (ValueError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    base = BenchSpec(
        input_len=args.input_len, output_len=args.output_len, num_requests=args.num_requests,
        seed=args.seed, prompt_kind=args.prompt_kind, vocab_size=args.vocab_size,
        long_every=args.long_every, long_input_len=args.long_input_len, model=args.model,
        api_key=args.api_key, dataset=args.dataset, num_turns=args.num_turns,
        num_groups=args.num_groups, prefix_len=args.prefix_len,
        return_token_ids=not args.no_token_ids, clients=args.clients,
        range_ratio=args.range_ratio,
    )
    specs = ([dataclasses.replace(base, request_rate=r) for r in rates] if rates else
             [dataclasses.replace(base, concurrency=c) for c in concs or [4]])
    if args.config:
        return _served_vs_engine(args, specs)
    if args.overrides or args.port is not None:
        flag = "--set" if args.overrides else "--port"
        print(f"error: {flag} needs --config (it sets the cluster bench starts; --url names a "
              "running server's port)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return bench_main(args.url, specs, args.json, sys.stdout, sys.stderr,
                          Path(args.out) if args.out else None)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
