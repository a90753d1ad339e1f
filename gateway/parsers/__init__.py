"""Output parsers of the chat API: reasoning (`<think>` blocks) and tool calls.

Names follow vLLM's and SGLang's `--reasoning-parser` / `--tool-call-parser` flags. "auto"
reads the chat template: a template that writes `<tool_call>` gets `hermes` (`qwen3_coder`
when it writes `<function=`), `[TOOL_CALLS]` gets `mistral`, DeepSeek's
`<｜tool▁calls▁begin｜>` gets `deepseek_v3`, and one that writes `<think>` gets the `qwen3`
reasoning parser. Llama 3 templates give no reliable sign: name `llama3_json` explicitly.
"""

from __future__ import annotations

from gateway.parsers.base import CallDelta, ToolDelta, ToolParser
from gateway.parsers.json_tools import HermesParser, Llama3JsonParser, MistralParser
from gateway.parsers.reasoning import REASONING_PARSERS, ThinkParser, prompt_opens_reasoning
from gateway.parsers.xml_tools import DeepSeekV3Parser, Qwen3CoderParser

TOOL_CALL_PARSERS = ("hermes", "qwen3", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3",
                     "deepseek_v31")
AUTO, NONE = "auto", "none"

__all__ = [
    "AUTO", "NONE", "REASONING_PARSERS", "TOOL_CALL_PARSERS", "CallDelta", "ThinkParser",
    "ToolDelta", "ToolParser", "detect_reasoning_parser", "detect_tool_call_parser",
    "make_tool_parser", "prompt_opens_reasoning",
]


def make_tool_parser(name: str, parameters: dict[str, dict[str, object]]) -> ToolParser:
    """A fresh parser (one per request: parsers hold streaming state)."""
    if name in ("hermes", "qwen3"):
        return HermesParser(parameters)
    if name == "qwen3_coder":
        return Qwen3CoderParser(parameters)
    if name == "llama3_json":
        return Llama3JsonParser(parameters)
    if name == "mistral":
        return MistralParser(parameters)
    if name in ("deepseek_v3", "deepseek_v31"):
        return DeepSeekV3Parser(parameters, v31=name == "deepseek_v31")
    raise ValueError(f"unknown tool-call parser {name!r}")


def detect_tool_call_parser(template: str) -> str:
    """The tool-call parser a chat template's text implies ("" when it shows none)."""
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    return ""


def detect_reasoning_parser(template: str) -> str:
    """The reasoning parser a chat template's text implies ("" when it shows none)."""
    return "qwen3" if "<think>" in template else ""
