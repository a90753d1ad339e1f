"""The embedded model's chat template: hermes / Qwen3 tools, tool results and thinking, rendered
the same by plain jinja2, the gateway's sandbox and transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jinja2
import jinja2.sandbox
import pytest
from tokenizers import Tokenizer

from orchestrator.tasks import lookup

transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tandem-arith"
TEMPLATE = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
# Keys in sorted order: jinja2's tojson sorts keys and transformers' keeps them, so this one
# renders the same in both.
TOOL = json.loads(json.dumps(lookup.LOOKUP_TOOL, sort_keys=True))
TOOL_JSON = json.dumps(TOOL, sort_keys=True)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def renderers() -> dict[str, Any]:
    plain = jinja2.Environment()
    sandbox = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    out = {}
    for name, env in (("plain", plain), ("gateway", sandbox)):
        env.globals["raise_exception"] = _raise
        template = env.from_string(TEMPLATE)
        out[name] = lambda t=template, **kw: t.render(**kw)
    hf = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    out["transformers"] = lambda **kw: hf.apply_chat_template(
        kw.pop("messages"), tokenize=False, **kw
    )
    return out


RENDERERS = renderers()


def render_all(**kw: Any) -> str:
    """The text every renderer produces; they must agree."""
    texts = {name: render(**kw) for name, render in RENDERERS.items()}
    assert len(set(texts.values())) == 1, texts
    return next(iter(texts.values()))


def calls(*names: str, as_text: bool = True) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "lookup",
                      "arguments": json.dumps({"name": n}) if as_text else {"name": n}}}
        for i, n in enumerate(names)
    ]


def call_text(name: str) -> str:
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"name": "{name}"}}}}\n</tool_call>'


def test_plain_conversation_and_the_generation_prompt() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a=1;"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "a?"},
    ]
    head = ("<|system|>Be brief.<|endoftext|><|user|>a=1;<|endoftext|><|assistant|>ok"
            "<|endoftext|><|user|>a?<|endoftext|>")
    assert render_all(messages=messages, add_generation_prompt=False) == head
    # Thinking off (the default, as Qwen3's enable_thinking=false): an empty think block.
    assert render_all(messages=messages, add_generation_prompt=True) == (
        head + "<|assistant|>" + EMPTY_THINK)
    assert render_all(messages=messages, add_generation_prompt=True, enable_thinking=False) == (
        head + "<|assistant|>" + EMPTY_THINK)
    # Thinking on: the model opens its own think block.
    assert render_all(messages=messages, add_generation_prompt=True, enable_thinking=True) == (
        head + "<|assistant|>")
    # A developer message is a system one.
    dev = [{"role": "developer", "content": "Be brief."}, *messages[1:]]
    assert render_all(messages=dev, add_generation_prompt=False) == head


def test_tools_go_first_in_one_system_turn() -> None:
    user = {"role": "user", "content": "q?"}
    tools_turn = f"<tools>\n{TOOL_JSON}\n</tools><|endoftext|>"
    assert render_all(messages=[user], tools=[TOOL], add_generation_prompt=True) == (
        f"<|system|>{tools_turn}<|user|>q?<|endoftext|><|assistant|>{EMPTY_THINK}")
    system = {"role": "system", "content": "Be brief."}
    assert render_all(messages=[system, user], tools=[TOOL, TOOL],
                      add_generation_prompt=False) == (
        f"<|system|>Be brief.\n\n<tools>\n{TOOL_JSON}\n{TOOL_JSON}\n</tools><|endoftext|>"
        "<|user|>q?<|endoftext|>")


def test_tool_calls_and_results_render_hermes_style() -> None:
    messages = [
        {"role": "user", "content": "q,b?"},
        {"role": "assistant", "tool_calls": calls("q", "b")},  # no content at all
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
        {"role": "tool", "tool_call_id": "call_1", "content": "07"},
    ]
    expected = (
        f"<|system|><tools>\n{TOOL_JSON}\n</tools><|endoftext|><|user|>q,b?<|endoftext|>"
        f"<|assistant|>{call_text('q')}\n{call_text('b')}<|endoftext|>"
        "<|user|><tool_response>\n42\n</tool_response>\n<tool_response>\n07\n</tool_response>"
        f"<|endoftext|><|assistant|>{EMPTY_THINK}"
    )
    assert render_all(messages=messages, tools=[TOOL], add_generation_prompt=True) == expected
    # Arguments as an object, empty content, and past reasoning left in the content: the same.
    again = [messages[0], {"role": "assistant", "content": "<think>\nq=?;b=?;\n</think>\n\n",
                           "tool_calls": calls("q", "b", as_text=False)}, *messages[2:]]
    assert render_all(messages=again, tools=[TOOL], add_generation_prompt=True) == expected
    # Content before the calls stays, a newline apart.
    said = [messages[0], {"role": "assistant", "content": "Let me look.",
                          "tool_calls": calls("q")}]
    assert render_all(messages=said, tools=[TOOL], add_generation_prompt=False).endswith(
        f"<|assistant|>Let me look.\n{call_text('q')}<|endoftext|>")


def test_an_unknown_role_is_refused() -> None:
    for render in RENDERERS.values():
        with pytest.raises(Exception, match="unknown role wizard"):
            render(messages=[{"role": "wizard", "content": "hi"}], add_generation_prompt=True)


def test_markers_are_single_tokens_kept_by_skip_special_tokens() -> None:
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<tools>", "</tools>"]
    ids = [tok.token_to_id(m) for m in markers]
    assert ids == list(range(103, 111))  # after the 103 special and character tokens
    added = tok.get_added_tokens_decoder()
    assert not any(added[i].special for i in ids)  # not special: the gateway's parsers see them
    text = "<|assistant|><think>\nq=?;\n</think>\n\n" + call_text("q") + "<|endoftext|>"
    enc = tok.encode(text, add_special_tokens=False).ids
    assert sum(i in ids for i in enc) == 4
    assert tok.decode(enc, skip_special_tokens=True) == text[len("<|assistant|>"):-len(
        "<|endoftext|>")]
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert tok.get_vocab_size() <= config["vocab_size"] == 128
