"""The `tandem` command line: serve, worker, gateway, launch, plan, eval, bench.

Every subcommand that runs cluster processes reads one cluster YAML (`--config`) and takes
`--set a.b=c` overrides; named flags (`--model`, `--port`, ...) are shorthands for overrides
and are applied before the `--set` ones. `main(argv)` returns the exit status (tests call it).
The worker and gateway code is imported only inside their subcommands, so the CLI stays light
(no torch import for plan, eval or bench). eval and bench, which only talk to a running
server, live in orchestrator/cli_client.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import signal
import sys
import threading
from pathlib import Path

from gateway.config import GatewayConfigError
from orchestrator.cli_args import build_parser, kv_dtype_override, parser_overrides
from orchestrator.cli_client import (
    EXIT_USAGE,
    cmd_bench,
    cmd_eval,
    url_problem,
)
from orchestrator.config import (
    ClusterConfig,
    ClusterConfigError,
    gateway_config,
    load_config,
    resolve_config_path,
)
from orchestrator.output import silence
from orchestrator.worker_config import worker_config
from worker.config import WorkerConfig


def _load(args: argparse.Namespace, extra: list[str] | None = None) -> ClusterConfig:
    """The config of args.config with the named flags' overrides (`extra`), then --set ones."""
    named = [*(extra or []), *kv_dtype_override(args)]
    return load_config(resolve_config_path(args.config), [*named, *args.overrides])


def _model_overrides(args: argparse.Namespace) -> list[str]:
    """--model / --served-model-name / --dtype as overrides."""
    extra: list[str] = []
    if args.model:
        model_dir = Path(args.model).expanduser()
        if model_dir.exists():
            name = args.served_model_name or model_dir.resolve().name
            extra += [f"model.path={model_dir.resolve()}", f"model.served_model_name={name}"]
        else:  # a Hugging Face name (ORG/NAME): the config resolves it from the local cache
            extra.append(f"model.path={args.model}")
            extra.append(f"model.served_model_name={args.served_model_name or ''}")
    elif args.served_model_name:
        extra.append(f"model.served_model_name={args.served_model_name}")
    if args.dtype:
        extra.append(f"model.dtype={args.dtype}")
    return extra


def serve_config(args: argparse.Namespace) -> ClusterConfig:
    """The config `tandem serve` runs: the file, then --model/--dtype/--port, then --set."""
    extra = _model_overrides(args)
    if args.port is not None:
        extra.append(f"gateway.port={args.port}")
    if args.api_key:
        extra.append(f"gateway.api_key={args.api_key}")
    if args.admin_key:
        extra.append(f"gateway.admin_key={args.admin_key}")
    if args.enforce_eager:
        extra.append("model.enforce_eager=true")
    extra.extend(parser_overrides(args))
    extra += kv_dtype_override(args)
    # `serve` is the local launcher by definition, whatever the file says; a --set asking for
    # another would be ignored, so it is refused.
    for text in args.overrides:
        key, _, value = text.partition("=")
        if key.strip() == "launcher.kind" and value.strip() != "local":
            raise ClusterConfigError(f"--set {text}: tandem serve runs the local launcher; run "
                                     "`tandem launch --config FILE` for slurm or ray")
    overrides = [*extra, *args.overrides, "launcher.kind=local"]
    return load_config(resolve_config_path(args.config), overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.launch import launch

    return launch(serve_config(args))


def cmd_worker(args: argparse.Namespace) -> int:
    if problem := url_problem(args.join, "--join"):  # not after 300 s of retried POSTs
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    cluster = _load(args)
    config = _worker_process_config(cluster, args)
    config.validate()
    if args.reexec:
        _reexec_with_bind_shim(config)
    if args.node_rank:
        from worker.tp_runner import run_node  # nodes 1..nnodes-1 run ranks only, no server

        run_node(config)
        return 0
    from transfer.config import TransferConfigError
    from worker.config import ConfigError
    from worker.model import ModelLoadError
    from worker.server import BindError, run_worker  # lazy: only a worker process loads the engine

    refused: list[str] = []
    on_drain = None
    if args.join:
        from orchestrator.config import dial_address
        from orchestrator.launch.join import Join

        admin_key = args.admin_key or cluster.gateway.admin_key
        join = Join(args.join, dial_address(config.host, config.port), config.role, admin_key,
                    cluster.launcher.ready_timeout_s)

        def stop_refused(reason: str) -> None:
            print(f"error: --join: {reason}", file=sys.stderr, flush=True)
            refused.append(reason)
            os.kill(os.getpid(), signal.SIGTERM)  # drain (nothing is held yet) and exit

        def leave() -> None:  # on the event loop: the HTTP call runs on a thread of its own
            threading.Thread(target=join.leave, name="leave", daemon=True).start()

        join.start(config.tls, stop_refused)
        on_drain = leave
    try:
        run_worker(config, on_drain=on_drain)
    except BindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ModelLoadError, ConfigError, TransferConfigError) as exc:  # a checkpoint or drafter
        print(f"error: {exc}", file=sys.stderr)  # it cannot load, a transfer backend it cannot
        # run (cuda_ipc without a CUDA driver): one line naming why and the fix, no traceback
        return EXIT_USAGE
    code = 1 if refused else 0
    if args.reexec:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End a worker process that has stopped cleanly without the interpreter's teardown.

    By now the server is stopped, the engine closed and the KV memory deregistered; what is
    left is module and C++ static teardown (torch, gRPC, the transfer engines), measured at
    0.5-5 s on this machine, which only delays the moment a drained worker is gone.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker_process_config(cluster: ClusterConfig, args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig of this process: its replica's, with --host/--port; with --join a
    replica beyond the configured ones on a free port."""
    rc = cluster.role(args.role)
    if args.port is not None and not 1 <= args.port <= 65535:  # gRPC binds 70000 as 4464
        raise ClusterConfigError(f"--port {args.port} is out of range: give one within 1..65535")
    if not 0 <= args.node_rank < rc.parallel.nnodes:
        raise ClusterConfigError(
            f"--node-rank {args.node_rank} is out of range: roles.{args.role}.parallel.nnodes is "
            f"{rc.parallel.nnodes} (0..{rc.parallel.nnodes - 1})")
    replica = rc.count if args.join and not args.replica else args.replica
    # A joining worker takes the role's settings (replica 0's); it reports its own replica.
    config = worker_config(cluster, args.role, 0 if args.join else replica)
    config = config.replace(replica=replica, host=args.host or config.host)
    if args.port is not None or args.join:
        from orchestrator.launch.ports import choose_port

        config = config.replace(port=args.port if args.port is not None
                                else choose_port(config.host))
    if not config.port:
        raise ClusterConfigError(f"roles.{args.role}.base_port is unset: pass --port N, set the "
                                 "base_port, or use the run's cluster.yaml (logs/<port>/), "
                                 "where the local launcher wrote the ports it chose")
    if args.node_rank:
        config = config.replace(parallel=dataclasses.replace(config.parallel,
                                                             node_rank=args.node_rank))
    return config


def _reexec_with_bind_shim(config: WorkerConfig) -> None:
    """Run this worker again with Mooncake's listeners held to its host (transfer/bind_host.py).

    Only from the real command line (a test calling main() must not be replaced)."""
    from transfer.bind_host import ShimUnavailable, cache_dir, worker_env

    try:
        env = worker_env(config.transfer.backend, config.role, config.host, os.environ)
    except ShimUnavailable as exc:
        print(f"warning: mooncake's listeners will bind every interface: {exc}", file=sys.stderr)
        return
    except OSError as exc:  # its cache directory cannot be written (a read-only home)
        print("warning: mooncake's listeners will bind every interface: cannot build the bind "
              f"shim in {cache_dir(os.environ)} ({exc.strerror or exc}); set TANDEM_CACHE_DIR "
              "(else XDG_CACHE_HOME) to a directory you can write", file=sys.stderr)
        return
    if env is not None:
        sys.stdout.flush()
        # Run the same script again (`tandem`), so `ps ... | grep tandem` finds this worker;
        # started as `python -m orchestrator.cli`, argv[0] is this file: run the module again.
        script = [sys.argv[0]] if Path(sys.argv[0]).name != Path(__file__).name else [
            "-m", "orchestrator.cli"]
        os.execve(sys.executable, [sys.executable, *script, *sys.argv[1:]], env)


def cmd_gateway(args: argparse.Namespace) -> int:
    extra = [f"gateway.admin_key={args.admin_key}"] if args.admin_key else []
    config = gateway_config(_load(args, [*extra, *parser_overrides(args)]))
    config.validate()
    from orchestrator.launch.ports import is_free

    try:
        free = is_free(config.host, config.port)
    except ClusterConfigError as exc:  # a host that does not resolve, or is not this machine's
        raise ClusterConfigError(f"gateway.host: {exc}") from None
    if not free:  # one line, before it dials any worker
        raise ClusterConfigError(
            f"port {config.port} (gateway, gateway.port) is in use on {config.host}: another "
            "gateway or cluster? stop it, or --set gateway.port=N")
    from gateway.server import run_gateway  # lazy: keeps torch-free commands light
    from gateway.tokenizer import TokenizerLoadError

    try:
        run_gateway(config)
    except TokenizerLoadError as exc:  # the file it names, in one line
        raise GatewayConfigError(str(exc)) from None
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from orchestrator.launch import launch

    return launch(_load(args))


def cmd_plan(args: argparse.Namespace) -> int:
    from orchestrator.devices import cuda_status
    from orchestrator.plan_text import format_plan

    if args.gpus is not None and args.gpus < 1:
        print(f"error: --gpus must be >= 1, got {args.gpus}", file=sys.stderr)
        return EXIT_USAGE
    port = [] if args.port is None else [f"gateway.port={args.port}"]  # serve's --port
    print(format_plan(_load(args, [*_model_overrides(args), *port]), cuda_status(args.gpus)))
    return 0


COMMANDS = {
    "serve": cmd_serve, "worker": cmd_worker, "gateway": cmd_gateway, "launch": cmd_launch,
    "plan": cmd_plan, "eval": cmd_eval, "bench": cmd_bench,
}


def _unrecognized(parser: argparse.ArgumentParser, command: str, arg: str) -> str:
    """One line for an argument the command does not take, with the closest flag it does."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = [f for action in sub.choices[command]._actions for f in action.option_strings]
    close = difflib.get_close_matches(arg.split("=")[0], flags, n=1)
    hint = f"did you mean {close[0]}?" if close else f"see tandem {command} --help"
    # A path typed without its flag, as other serving CLIs take a positional model or config.
    if arg.endswith((".yaml", ".yml")) and "--config" in flags:
        hint = f"did you mean --config {arg}?"
    elif (Path(arg) / "config.json").is_file() and "--model" in flags:
        hint = f"did you mean --model {arg}?"
    elif arg.split("=")[0] in ("--quantization", "-q") and "--model" in flags:  # vLLM's flag
        hint = ("Tandem does not quantize at load; serve a block-scaled FP8 checkpoint, or make "
                "one with python -m models.make_fp8 SRC DST")
    return f"tandem {command}: unrecognized argument {arg!r}; {hint}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tandem` console script; returns the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): a status, not an exit, for callers
        return int(exc.code or 0)
    if extra:
        print(f"error: {_unrecognized(parser, args.command, extra[0])}", file=sys.stderr)
        return EXIT_USAGE
    from orchestrator.launch import LauncherUnavailableError

    # A worker may re-execute itself (the bind-host shim) only when run as a program.
    args.reexec = argv is None
    if argv is None:  # a launched worker or gateway ends with its launcher
        from orchestrator.launch.processes import die_with_launcher

        die_with_launcher()
        # Started with SIGINT ignored (a script's `tandem serve &`), Python installs no
        # KeyboardInterrupt: `kill -INT` was lost until the launcher's own handler, and a serve
        # stopped during its checks went on to start the cluster. SIGINT stops us throughout.
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling (imports, checks):
        print("interrupted", file=sys.stderr)  # nothing was started yet
        return 130
    except BrokenPipeError:  # `tandem plan | head`: the reader has gone; no traceback
        silence(sys.stdout)
        return 141  # what a shell reports for a command SIGPIPE ended
    except (ClusterConfigError, GatewayConfigError, LauncherUnavailableError) as exc:
        message = str(exc)  # the gateway's own start reads files too
        for override, flag in _flags_typed(args).items():  # name the flag the user typed
            message = message.replace(f"--set {override!r}", flag)
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE


# The named flags that stand for a `--set` override (serve_config, _model_overrides, ...).
_FLAG_OF = {"gateway.port": "port", "gateway.api_key": "api_key",
            "gateway.admin_key": "admin_key", "model.dtype": "dtype",
            "model.served_model_name": "served_model_name", "model.path": "model",
            "gateway.reasoning_parser": "reasoning_parser",
            "gateway.tool_call_parser": "tool_call_parser",
            "gateway.generation_config": "generation_config",
            "cache.kv_cache_dtype": "kv_cache_dtype"}


def _flags_typed(args: argparse.Namespace) -> dict[str, str]:
    """Override text -> the flag (and value) the user typed for it, for the flags given."""
    out = {}
    for key, dest in _FLAG_OF.items():
        value = getattr(args, dest, None)
        if value is not None and value != "":
            flag = f"--{dest.replace('_', '-')} {value}"
            out[f"{key}={value}"] = flag
            if key == "model.path":  # a local directory is passed resolved
                out[f"{key}={Path(str(value)).expanduser().resolve()}"] = flag
    return out


if __name__ == "__main__":
    sys.exit(main())
