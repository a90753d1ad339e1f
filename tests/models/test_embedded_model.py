"""The embedded checkpoint models/tandem-arith: files, offline loading, tokenizer, and greedy
accuracy on held-out `arith` problems (the chat template: test_chat_template.py; tool use and
thinking: test_embedded_tools.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the checkpoint must load with no network

import pytest
import torch
from tokenizers import Tokenizer

from orchestrator.tasks import arith

transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tandem-arith"
HELD_OUT_SEED = 1  # an evaluation seed (< arith.TRAIN_SEED_MIN): never seen in training


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


def greedy(
    model: transformers.PreTrainedModel, tok: transformers.PreTrainedTokenizerBase, texts: list[str]
) -> list[str]:
    """Greedy completions, batched with left padding."""
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=arith.ANSWER_MAX_TOKENS, do_sample=False)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_checkpoint_files() -> None:
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["torch_dtype"] == "float32"
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size < 8 * 2**20  # a few MB: it lives in git
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    tok_config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|endoftext|>"
    assert gen["eos_token_id"] == Tokenizer.from_file(
        str(MODEL_DIR / "tokenizer.json")
    ).token_to_id("<|endoftext|>")


def test_loads_offline_with_transformers(
    model: transformers.PreTrainedModel, hf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    assert hf_tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert len(hf_tokenizer) <= model.config.vocab_size


def test_plain_tokenizers_library(
    tokenizer: Tokenizer, hf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    text = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    enc = tokenizer.encode(text)
    assert len(enc.ids) == len(text)  # one token per character
    assert tokenizer.decode(enc.ids) == text
    # The same tokenizer both ways.
    assert enc.ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = tokenizer.token_to_id("<|unk|>")
    assert tokenizer.encode("é€😀").ids == [unk, unk, unk]  # unknown characters never crash
    for special in ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert tokenizer.encode(special).ids == [tokenizer.token_to_id(special)]
    # Decoding skips special tokens.
    assert tokenizer.decode(tokenizer.encode("<|user|>ab<|endoftext|>").ids) == "ab"


def test_greedy_accuracy_on_held_out_problems(
    model: transformers.PreTrainedModel, hf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    problems = arith.make_problems(50, HELD_OUT_SEED)
    raw = greedy(model, hf_tokenizer, [p.prompt for p in problems])
    chat = greedy(
        model,
        hf_tokenizer,
        [
            hf_tokenizer.apply_chat_template(
                [{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True
            )
            for p in problems
        ],
    )
    raw_acc = sum(map(arith.score, problems, raw)) / len(problems)
    chat_acc = sum(map(arith.score, problems, chat)) / len(problems)
    assert raw_acc >= 0.9, list(zip(raw, problems, strict=True))[:5]
    assert chat_acc >= 0.9, list(zip(chat, problems, strict=True))[:5]
    # It ends its answers with STOP.
    assert all(c.startswith(arith.extract_answer(c) + arith.STOP) for c in raw)


def test_answers_follow_the_first_page(
    model: transformers.PreTrainedModel, hf_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    """Rewrite the first assignment's value (page 0): the model's answer changes with it."""
    problems = arith.make_problems(30, HELD_OUT_SEED + 1)
    changed = []
    for p in problems:
        old = p.prompt[2:4]
        new = f"{(int(old) + 37) % 100:02d}"
        changed.append(
            arith.Problem(
                prompt=p.prompt[:2] + new + p.prompt[4:],
                answer=p.answer.replace(f"={old},", f"={new},", 1),
            )
        )
    completions = greedy(model, hf_tokenizer, [p.prompt for p in changed])
    assert all(arith.solve(p.prompt) == p.answer for p in changed)
    assert sum(map(arith.score, changed, completions)) / len(changed) >= 0.9
    assert sum(map(arith.score, problems, completions)) == 0  # none still gives the old answer
