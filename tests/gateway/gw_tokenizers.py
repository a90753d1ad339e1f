"""Tokenizers for the gateway's tests, built offline: a byte-level BPE with a ChatML template,
and the same with agent marker tokens (Qwen3's added, Mistral's special) under a given template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello gateway",
    "héllo wörld ünïcode",
    "日本語のテキスト",
    "emoji 🙂 and 🚀 rockets",
    "a+b=c; k3=41; answer: 42",
    "STOP here and END there",
    "one two three four five six seven eight nine ten",
]


def build_tokenizer(path: Path, with_template: bool = True) -> Path:
    """A byte-level BPE tokenizer (multi-byte characters span tokens) saved HF-style."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg: dict[str, object] = {"eos_token": "<|im_end|>", "bos_token": None}
    if with_template:
        cfg["chat_template"] = CHATML
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


# A Qwen3-style (hermes) chat template, written for these tests: tools listed in the system
# turn inside <tools></tools>, calls as <tool_call> JSON, tool results as <tool_response> in a
# user turn, and an `enable_thinking` kwarg (false: an empty think block in the prompt).
HERMES_TEMPLATE = """\
{%- set sys = messages[0].content if messages[0].role == 'system' else '' -%}
{%- if tools -%}
<|im_start|>system
{% if sys %}{{ sys }}

{% endif %}Functions you may call are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one by writing <tool_call>
{"name": <name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif sys -%}
<|im_start|>system
{{ sys }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- if m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- elif m.role == 'assistant' -%}
<|im_start|>assistant
{% generation %}{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {% if tc.function.arguments is string -%}
{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}{% endgeneration %}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""

# A DeepSeek-R1-style template: the generation prompt opens the think block itself.
OPEN_THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Marker tokens as Qwen3 and Mistral vocabularies hold them: Qwen's are added, not special;
# Mistral's are special (their text is dropped by skip_special_tokens).
AGENT_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
AGENT_SPECIALS = ["[TOOL_CALLS]", "[ARGS]"]


def build_agent_tokenizer(path: Path, template: str) -> Path:
    """The test tokenizer plus agent marker tokens, with `template` as its chat template."""
    build_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_ADDED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in AGENT_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path
