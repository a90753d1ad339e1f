"""A tiny random Qwen3 checkpoint that chats like Qwen3: a byte-level BPE tokenizer with Qwen3's
special and added tokens (`<|im_start|>`, `<|im_end|>`, `<think>`, `<tool_call>`, ...) and
Qwen3's own chat template (tests/e2e/qwen3_chat_template.jinja: tools, tool results, thinking).

Its weights are random, so its free text means nothing; what it writes under a grammar (a
forced tool call, a JSON schema) is well formed, and that is what the agent tests read. With
the template as shipped the gateway's `auto` parsers resolve to hermes and qwen3."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.worker.conftest import build_tiny_checkpoint

TEMPLATE = Path(__file__).with_name("qwen3_chat_template.jinja")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
         "</tool_response>"]  # Qwen3's: added tokens, not special (their text is output)
CORPUS = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
          "the quick brown fox jumps over the lazy dog 0123456789",
          '{"a": [1, 2, 3], "b": {"c": true, "d": null, "e": false}} -+.eE',
          "Hello! How can I help you today? The answer is 42.",
          "# Tools You may call one or more functions user assistant system"]


def build_qwen3_chat_checkpoint(path: Path, seed: int = 0) -> Path:
    """The checkpoint in `path` (config, safetensors, tokenizer files); returns `path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    eos = tok.token_to_id("<|im_end|>")
    build_tiny_checkpoint(path, "qwen3", seed=seed, vocab_size=tok.get_vocab_size(),
                          max_position_embeddings=2048, eos_token_id=eos, pad_token_id=0,
                          bos_token_id=None, initializer_range=0.02)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 2048,
        "chat_template": TEMPLATE.read_text()}, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path
