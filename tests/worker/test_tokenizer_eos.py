"""The tokenizer's own eos_token (tokenizer_config.json) is a stop token too, as vLLM and SGLang
stop on it beside generation_config.json's ids. A ChatML fine-tune of a Llama or Mistral base
keeps config.json's eos 2 (`</s>`) and its generation_config.json, and says `<|im_end|>` in
tokenizer_config.json: the model ends each turn with it, and ours wrote past it into a made-up
next turn until max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken

from tests.worker.grammar_tokenizers import byte_level_bpe
from worker.arch.load import load_arch_config

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 700, "max_position_embeddings": 64,
          "eos_token_id": 0}


def _checkpoint(path: Path, eos_token: object, generation: dict | None) -> int:
    """A config.json whose eos is id 0, a tokenizer with `<|im_end|>`; that token's id."""
    tok = byte_level_bpe()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None
    return im_end


@pytest.mark.parametrize("generation", [None, {"eos_token_id": [0, 1]}])
@pytest.mark.parametrize("as_dict", [False, True])
def test_the_tokenizers_eos_stops_too(tmp_path: Path, generation: dict | None,
                                      as_dict: bool) -> None:
    eos: object = "<|im_end|>"
    if as_dict:  # tokenizer_config.json writes it either way
        eos = {"content": "<|im_end|>", "special": True, "__type": "AddedToken"}
    im_end = _checkpoint(tmp_path, eos, generation)
    want = (0, 1, im_end) if generation else (0, im_end)
    assert load_arch_config(tmp_path).eos_token_ids == want


def test_an_eos_the_vocabulary_lacks_adds_nothing(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "<|not_a_token|>", None)
    assert load_arch_config(tmp_path).eos_token_ids == (0,)
    (tmp_path / "tokenizer.json").unlink()  # token-id mode: no vocabulary to look it up in
    assert load_arch_config(tmp_path).eos_token_ids == (0,)
