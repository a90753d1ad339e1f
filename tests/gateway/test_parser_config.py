"""The parser settings: validation naming the field, the flags, and "auto" from the template."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.app import resolve_parsers
from gateway.config import GatewayConfig, GatewayConfigError
from gateway.parsers import detect_reasoning_parser, detect_tool_call_parser
from gateway.tokenizer import Tokenizer
from orchestrator.cli import build_parser, serve_config
from orchestrator.config import ClusterConfigError, gateway_config, load_config


def base() -> GatewayConfig:
    return GatewayConfig(model_path="x", workers=("127.0.0.1:1",))


@pytest.mark.parametrize("name", ["reasoning_parser", "tool_call_parser"])
def test_unknown_parser_names_the_field(name: str) -> None:
    with pytest.raises(GatewayConfigError, match=f"gateway.{name} must be one of auto"):
        dataclasses.replace(base(), **{name: "bogus"}).validate()


# The default configs leave worker ports to the local launcher; a gateway config needs them.
PINNED = ["roles.prefill.base_port=30000", "roles.decode.base_port=31000"]
PORTS = [arg for pin in PINNED for arg in ("--set", pin)]


def test_flags_set_the_gateway_keys() -> None:
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1",
                                      "--tool-call-parser", "llama3_json", *PORTS])
    gw = gateway_config(serve_config(args))
    assert (gw.reasoning_parser, gw.tool_call_parser) == ("deepseek_r1", "llama3_json")
    args = build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(ClusterConfigError, match="gateway.tool_call_parser"):
        serve_config(args)


def test_defaults_are_auto() -> None:
    assert (base().reasoning_parser, base().tool_call_parser) == ("auto", "auto")


@pytest.mark.parametrize(("config", "pins"), [("configs/tiny-1p1d.yaml", PINNED),
                                              ("configs/tiny-mono.yaml",
                                               ["roles.both.base_port=30000"])])
def test_tiny_configs_name_the_embedded_models_parsers(config: str, pins: list[str]) -> None:
    """The shipped configs name them; "auto" on the embedded model's template agrees."""
    gw = gateway_config(load_config(Path(config), pins))
    assert (gw.reasoning_parser, gw.tool_call_parser) == ("qwen3", "hermes")
    auto = resolve_parsers(base(), Tokenizer.from_dir(Path(gw.model_path)))
    assert (auto.reasoning, auto.tool_call) == ("qwen3", "hermes")


def test_auto_reads_the_template(hermes_dir: Path, tok_dir: Path) -> None:
    assert resolve_parsers(base(), Tokenizer.from_dir(hermes_dir)).reasoning == "qwen3"
    assert resolve_parsers(base(), Tokenizer.from_dir(hermes_dir)).tool_call == "hermes"
    plain = resolve_parsers(base(), Tokenizer.from_dir(tok_dir))
    assert (plain.reasoning, plain.tool_call) == ("", "")
    off = dataclasses.replace(base(), reasoning_parser="none", tool_call_parser="mistral")
    assert resolve_parsers(off, Tokenizer.from_dir(hermes_dir)).reasoning == ""
    assert resolve_parsers(off, Tokenizer.from_dir(hermes_dir)).tool_call == "mistral"
    assert detect_tool_call_parser("<tool_call><function=x>") == "qwen3_coder"
    assert detect_tool_call_parser("[TOOL_CALLS]") == "mistral"
    assert detect_tool_call_parser("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_reasoning_parser("no thinking here") == ""
