"""The `tandem` command line: serve, worker, gateway, launch, plan, eval, bench.

Every subcommand that runs cluster processes reads one cluster YAML (`--config`) and takes
`--set a.b=c` overrides; named flags (`--model`, `--port`, ...) are shorthands for overrides
and are applied before the `--set` ones. `main(argv)` returns the exit status (tests call it).
The worker and gateway code is imported only inside their subcommands, so the CLI stays light
(no torch import for plan, eval or bench).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

from orchestrator.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    ClusterConfig,
    ClusterConfigError,
    EvalGate,
    gateway_config,
    load_config,
    worker_config,
)

EXIT_USAGE = 2  # bad flags or config, unreachable server


def resolve_config_path(path: str | None) -> Path:
    """--config as given; a relative path missing here is looked up in the repository."""
    if path is None:
        return DEFAULT_CONFIG
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--config", required=required, metavar="PATH",
                   help="cluster YAML" + ("" if required else f" (default: configs/{DEFAULT_CONFIG.name})"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set roles.decode.count=2 --set transfer.backend=nixl (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: disaggregated prefill/decode LLM serving. One YAML describes the cluster.",
        epilog="Example: tandem serve   (the embedded model, 1 prefill + 1 decode, http://127.0.0.1:8000)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run a whole cluster here in the foreground (local launcher)",
                       description="Start every worker and the gateway on this machine; Ctrl-C stops them in order.")
    _add_config_args(p, required=False)
    p.add_argument("--model", metavar="DIR", help="HF-format model directory (served name = its name)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients use")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights and KV dtype")
    p.add_argument("--port", type=int, metavar="N", help="the gateway's HTTP port")
    p.add_argument("--api-key", metavar="KEY", help="clients must send `Authorization: Bearer KEY` (default: no auth)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps eagerly (no CUDA graphs)")

    p = sub.add_parser("worker", help="run one worker process (what launchers start)")
    _add_config_args(p, required=True)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--replica", type=int, default=0, metavar="I", help="replica index within the role (default 0)")
    p.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="which of the replica's parallel.nnodes nodes this is (0 serves gRPC; default 0)")

    p = sub.add_parser("gateway", help="run the HTTP gateway process (what launchers start)")
    _add_config_args(p, required=True)

    p = sub.add_parser("launch", help="run the launcher the config names (launcher.kind)")
    _add_config_args(p, required=True)

    p = sub.add_parser("plan", help="print the process table and KV budget of a config")
    _add_config_args(p, required=True)

    gate = EvalGate()
    p = sub.add_parser(
        "eval", help="score a task against a server; non-zero below the bar",
        description="Prints `accuracy: X (k/N)`; exits 1 below --min-accuracy, 2 if the server "
                    "is unreachable. arith: raw prompts through /v1/completions. lookup: the tool "
                    "loop (call, tool result, answer) through /v1/chat/completions.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--config", metavar="PATH",
                   help="take the defaults below from this config's eval section")
    p.add_argument("--task", help=f"task family: arith or lookup (default {gate.task})")
    p.add_argument("--samples", type=int, help=f"number of problems (default {gate.samples})")
    p.add_argument("--concurrency", type=int,
                   help=f"requests in flight (default {gate.concurrency})")
    p.add_argument("--min-accuracy", type=float,
                   help=f"the bar, 0..1 (default {gate.min_accuracy})")
    p.add_argument("--seed", type=int, help=f"problem seed (default {gate.seed})")
    p.add_argument("--enable-thinking", action="store_true",
                   help="tool tasks: send chat_template_kwargs {enable_thinking: true} and require "
                        "reasoning_content in every reply")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default="", help="bearer token, if the server wants one")

    p = sub.add_parser("bench", help="synthetic streaming workload against an OpenAI-compatible URL")
    p.add_argument("--url", required=True, help="server base URL")
    p.add_argument("--input-len", type=int, default=128, help="prompt length (characters or token ids)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--num-requests", type=int, default=64)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 4)")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second")
    p.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                   help="random text, or random token-id lists (exact lengths where the server takes ids)")
    p.add_argument("--vocab-size", type=int, default=32, help="ids: draw token ids from [1, N)")
    p.add_argument("--long-every", type=int, default=0, metavar="K",
                   help="mixed load: every K-th request has a --long-input-len prompt")
    p.add_argument("--long-input-len", type=int, default=1024, metavar="M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default="")
    return parser


def _load(args: argparse.Namespace, extra: list[str] | None = None) -> ClusterConfig:
    """The config of args.config with the named flags' overrides (`extra`), then --set ones."""
    return load_config(resolve_config_path(args.config), [*(extra or []), *args.overrides])


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The config `tandem serve` runs: the file, then --model/--dtype/--port, then --set."""
    extra: list[str] = []
    if args.model:
        model_dir = Path(args.model).expanduser()
        extra.append(f"model.path={model_dir.resolve() if model_dir.exists() else model_dir}")
        extra.append(f"model.served_model_name={args.served_model_name or model_dir.resolve().name}")
    elif args.served_model_name:
        extra.append(f"model.served_model_name={args.served_model_name}")
    if args.dtype:
        extra.append(f"model.dtype={args.dtype}")
    if args.port is not None:
        extra.append(f"gateway.port={args.port}")
    if args.api_key:
        extra.append(f"gateway.api_key={args.api_key}")
    if args.enforce_eager:
        extra.append("model.enforce_eager=true")
    # `serve` is the local launcher by definition, whatever the file or --set says.
    overrides = [*extra, *args.overrides, "launcher.kind=local"]
    return load_config(resolve_config_path(args.config), overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.launch import launch

    return launch(serve_config(args))


def cmd_worker(args: argparse.Namespace) -> int:
    config = worker_config(_load(args), args.role, args.replica)
    if args.node_rank:
        config = config.replace(parallel=dataclasses.replace(config.parallel, node_rank=args.node_rank))
    config.validate()
    if args.node_rank:
        from worker.tp_runner import run_node  # nodes 1..nnodes-1 run ranks only, no server

        run_node(config)
        return 0
    from worker.server import run_worker  # lazy: only a worker process loads the engine

    run_worker(config)
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    config = gateway_config(_load(args))
    config.validate()
    from gateway.server import run_gateway  # lazy: keeps torch-free commands light

    run_gateway(config)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from orchestrator.launch import launch

    return launch(_load(args))


def cmd_plan(args: argparse.Namespace) -> int:
    from orchestrator.plan import format_plan

    print(format_plan(_load(args)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from orchestrator.client import ServerError
    from orchestrator.eval import report, run_eval
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
    try:
        if tool_loop:
            from orchestrator.eval_tools import run_tool_eval  # lazy: imports the openai client

            result = asyncio.run(run_tool_eval(
                args.url, task, samples, concurrency, seed, args.model, args.api_key,
                enable_thinking=args.enable_thinking,
            ))
        else:
            result = asyncio.run(run_eval(
                args.url, task, samples, concurrency, seed, args.model, args.api_key,  # type: ignore[arg-type]
            ))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return report(result, bar, sys.stdout, sys.stderr)


def _load_eval_gate(config: str | None) -> EvalGate:
    return load_config(resolve_config_path(config)).eval if config else EvalGate()


def cmd_bench(args: argparse.Namespace) -> int:
    from orchestrator.bench import BenchSpec, bench_main

    for name in ("input_len", "output_len", "num_requests"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return EXIT_USAGE
    if args.vocab_size < 2:
        print(f"error: --vocab-size must be >= 2, got {args.vocab_size}", file=sys.stderr)
        return EXIT_USAGE
    rate = args.request_rate or 0.0
    spec = BenchSpec(
        input_len=args.input_len, output_len=args.output_len, num_requests=args.num_requests,
        concurrency=0 if rate > 0 else (args.concurrency or 4), request_rate=rate, seed=args.seed,
        prompt_kind=args.prompt_kind, vocab_size=args.vocab_size, long_every=max(args.long_every, 0),
        long_input_len=args.long_input_len, model=args.model, api_key=args.api_key,
    )
    return bench_main(args.url, spec, args.json, sys.stdout, sys.stderr)


COMMANDS = {
    "serve": cmd_serve, "worker": cmd_worker, "gateway": cmd_gateway, "launch": cmd_launch,
    "plan": cmd_plan, "eval": cmd_eval, "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tandem` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): a status, not an exit, for callers
        return int(exc.code or 0)
    from orchestrator.launch import LauncherUnavailableError

    try:
        return COMMANDS[args.command](args)
    except (ClusterConfigError, LauncherUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
