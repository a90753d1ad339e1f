"""Small real tokenizers for the grammar tests, trained offline with `tokenizers` in a second.

- `byte_level_bpe()`: GPT-2 / Llama-3 / Qwen style (ByteLevel pre-tokenizer and decoder), with
  a special `<|endoftext|>` and a non-special added `<tool_call>` (as Qwen ships it).
- `byte_fallback_bpe()`: Llama-2 / Mistral style (Metaspace "▁", `<0xNN>` byte pieces).
The embedded model's tokenizer (character level, WordLevel) is the third kind the tests use.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tandem-arith" / "tokenizer.json"

# Text with the characters JSON, regexes and the test grammars use.
CORPUS = [
    '{"name": "alice", "age": 31, "tags": ["x", "y"], "ok": true, "score": -2.5e3}',
    "the quick brown fox jumps over the lazy dog 0123456789 ;:,.!?()[]{}<>=+-*/\\|'\"_#@$%^&~`",
    "yes no maybe red green blue id-42 ab1 cd9 <tool_call> </tool_call> hello world",
    "Ünïcödé ∑ 東京 naïve café",
] * 20


def byte_level_bpe(vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return tok


def byte_fallback_bpe(vocab_size: int = 400) -> Tokenizer:
    """SentencePiece-like: "▁" for spaces, a leading one prepended, unknown bytes as <0xNN>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.normalizer = normalizer  # type: ignore[assignment]
    split = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.pre_tokenizer = split  # type: ignore[assignment]
    decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                 decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.decoder = decoder  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # The 256 byte pieces after the trained vocabulary, as Llama-2's tokenizer.json has them.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def embedded() -> Tokenizer:
    return Tokenizer.from_file(str(EMBEDDED))
