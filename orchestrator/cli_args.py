"""The `tandem` command line's arguments: the parser of every subcommand (orchestrator/cli.py
runs them; eval's and bench's arguments are orchestrator/cli_client.py's) and the overrides
its shorthand flags stand for. Usage errors are one line naming the command and the argument
(`_Parser`), not argparse's usage block."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

from orchestrator.cli_client import EXIT_USAGE, add_client_commands
from orchestrator.config import DEFAULT_CONFIG

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # worker/config.py KV_CACHE_DTYPES (no worker import here)


def _add_config_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--config", required=required, metavar="PATH",
                   help="cluster YAML"
                        + ("" if required else f" (default: configs/{DEFAULT_CONFIG.name})"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set roles.decode.count=2 "
                        "--set transfer.backend=nixl (repeatable)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR|ORG/NAME",
                   help="HF-format model directory, or a Hugging Face name in the local cache "
                        "(HF_HOME; offline); served as the directory's name or ORG/NAME")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients use")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype")


def _add_parser_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reasoning-parser", metavar="NAME",
                   help="split <think> reasoning into reasoning_content: auto (from the chat "
                        "template) | none | qwen3 | deepseek_r1 (gateway.reasoning_parser)")
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="parse tool calls into tool_calls: auto | none | hermes | qwen3 | "
                        "qwen3_coder | llama3_json | mistral | deepseek_v3 | deepseek_v31 "
                        "(gateway.tool_call_parser)")
    p.add_argument("--generation-config", choices=["auto", "none"],
                   help="auto: a request's unset sampling fields take the model's "
                        "generation_config.json values; none: the API's defaults "
                        "(gateway.generation_config)")


def parser_overrides(args: argparse.Namespace) -> list[str]:
    """--reasoning-parser / --tool-call-parser / --generation-config as `gateway.*` overrides."""
    names = ("reasoning_parser", "tool_call_parser", "generation_config")
    return [f"gateway.{name}={value}" for name in names if (value := getattr(args, name))]


def _add_kv_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, metavar="|".join(KV_CACHE_DTYPES),
                   help="KV cache storage (= --set cache.kv_cache_dtype=...): auto = the model "
                        "dtype, fp8_e4m3 = one byte per element with the checkpoint's K/V "
                        "scales (else 1.0)")


def kv_dtype_override(args: argparse.Namespace) -> list[str]:
    value = getattr(args, "kv_cache_dtype", None)
    return [f"cache.kv_cache_dtype={value}"] if value else []


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors in one line naming the command, the argument and where
    to look (`error: tandem plan: argument --dtype: invalid choice: 'fp16' (choose from ...)`),
    not a usage block; a misspelt command gets the closest one."""

    def error(self, message: str) -> NoReturn:
        hint = f"see {self.prog} --help"
        commands = [c for a in self._actions if isinstance(a, argparse._SubParsersAction)
                    for c in a.choices]
        if commands and "required: COMMAND" in message:
            message, hint = f"give a command: {', '.join(commands)}", "see tandem --help"
        elif commands and message.startswith("argument COMMAND: invalid choice:"):
            typed = message.split("'")[1] if "'" in message else ""
            close = difflib.get_close_matches(typed, commands, n=1)
            message = f"unknown command {typed!r} (commands: {', '.join(commands)})"
            hint = f"did you mean {close[0]}?" if close else hint
        if "invalid choice" in message and "(choose from" in message:
            hint = ""  # the choices are the hint
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}{'; ' + hint if hint else ''}\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="tandem",
        description="Tandem: disaggregated prefill/decode LLM serving. "
                    "One YAML describes the cluster.",
        epilog="Example: tandem serve   "
               "(the embedded model, 1 prefill + 1 decode, http://127.0.0.1:8000)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run a whole cluster here in the foreground (local launcher)",
                       description="Start every worker and the gateway on this machine; "
                                   "Ctrl-C stops them in order.")
    _add_config_args(p, required=False)
    _add_model_args(p)
    p.add_argument("--port", type=int, metavar="N", help="the gateway's HTTP port")
    p.add_argument("--api-key", metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` (default: no auth)")
    p.add_argument("--admin-key", metavar="KEY",
                   help="key of the admin routes (/workers, /metrics); separate from --api-key")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly (no CUDA graphs)")
    _add_parser_args(p)
    _add_kv_dtype_arg(p)

    p = sub.add_parser("worker", help="run one worker process (what launchers start)")
    _add_config_args(p, required=True)
    p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--replica", type=int, default=0, metavar="I",
                   help="replica index within the role (default 0)")
    p.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="which of the replica's parallel.nnodes nodes this is "
                        "(0 serves gRPC; default 0)")
    _add_kv_dtype_arg(p)
    p.add_argument("--host", metavar="H", help="bind and be dialed here (default: the role's host)")
    p.add_argument("--port", type=int, metavar="N",
                   help="gRPC port (default: the replica's; with --join a free one)")
    p.add_argument("--join", metavar="URL",
                   help="add this worker to the running gateway at URL (http://HOST:PORT, or the "
                        "client base URL .../v1) with POST /workers once it "
                        "is SERVING, and leave it when draining; use the run's cluster.yaml "
                        "(logs/<port>/cluster.yaml) so the cluster id matches")
    p.add_argument("--admin-key", metavar="KEY",
                   help="the gateway's admin key for --join (default: gateway.admin_key)")

    p = sub.add_parser("gateway", help="run the HTTP gateway process (what launchers start)")
    _add_config_args(p, required=True)
    p.add_argument("--admin-key", metavar="KEY",
                   help="key of the admin routes (/workers, /metrics)")
    _add_parser_args(p)

    p = sub.add_parser("launch", help="run the launcher the config names (launcher.kind)")
    _add_config_args(p, required=True)
    _add_kv_dtype_arg(p)

    p = sub.add_parser("plan",
        help="print the process table, KV budget and weight bytes of what serve would run")
    _add_config_args(p, required=False)
    _add_model_args(p)
    _add_kv_dtype_arg(p)
    p.add_argument("--port", type=int, metavar="N", help="the gateway's HTTP port (as serve)")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="plan for a machine with N CUDA GPUs (default: probe this one)")

    add_client_commands(sub)
    return parser
