"""Held-out measurement for models/train_arith.py: teacher-forced and greedy accuracy per format.

Held-out samples come from evaluation seeds (< arith.TRAIN_SEED_MIN) at the evaluation sizes
(20+ assignments), drawn format after format from one `random.Random(seed)`; the trainer draws
only from seeds >= arith.TRAIN_SEED_MIN, so the two never share a stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from chat_data import EOS, Format, Sample, SampleMaker
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from orchestrator.tasks import arith

EVAL_MIN_ASSIGNMENTS = 20  # the evaluation range of both task families


@dataclass
class Example:
    ids: list[int]  # prompt + completion (which ends with eos)
    num_prompt_tokens: int  # the loss starts here


def encode(tok: Tokenizer, sample: Sample) -> Example:
    prompt_ids = tok.encode(sample.prompt).ids
    return Example(prompt_ids + tok.encode(sample.completion).ids, len(prompt_ids))


def collate(batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, T] and next-token labels [B, T] (-100 = no loss)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # pad id 0; causal: pads come after
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, e in enumerate(batch):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        # labels[t] is the token at t+1: the loss starts at the last prompt position
        labels[row, e.num_prompt_tokens - 1 : len(e.ids) - 1] = torch.tensor(
            e.ids[e.num_prompt_tokens :]
        )
    return ids, labels


def held_out_samples(n: int, seed: int) -> dict[Format, list[Sample]]:
    """`n` evaluation-seed samples of every format."""
    maker = SampleMaker(EVAL_MIN_ASSIGNMENTS)
    rng = random.Random(seed)
    return {fmt: [maker.draw(rng, fmt) for _ in range(n)] for fmt in Format}


@torch.no_grad()
def teacher_forced_accuracy(model: Qwen3ForCausalLM, examples: list[Example]) -> float:
    """Share of examples whose every completion token is the argmax given the gold prefix.

    Equal to greedy exact-match accuracy (greedy reproduces the completion iff each step's
    argmax is the gold token), at one forward pass per batch instead of one per token.
    """
    model.eval()
    right = 0
    for start in range(0, len(examples), 50):
        ids, labels = (t.to(model.device) for t in collate(examples[start : start + 50]))
        pred = model(input_ids=ids).logits.argmax(-1)  # [B, T]
        mask = labels != -100
        right += int(((pred == labels) | ~mask).all(dim=1).sum())
    model.train()
    return right / len(examples)


@torch.no_grad()
def generate(
    model: Qwen3ForCausalLM, hf_tok: PreTrainedTokenizerFast, prompts: list[str], max_new: int
) -> list[list[int]]:
    """Greedy continuations (token ids, cut after the first eos), batched with left padding."""
    model.eval()
    hf_tok.padding_side = "left"  # generation continues from the right edge
    eos = hf_tok.convert_tokens_to_ids(EOS)
    out: list[list[int]] = []
    for start in range(0, len(prompts), 50):
        enc = hf_tok(
            prompts[start : start + 50], return_tensors="pt", padding=True,
            add_special_tokens=False,
        ).to(model.device)
        gen = model.generate(
            **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=hf_tok.pad_token_id
        )
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    model.train()
    return out


def greedy_accuracy(
    model: Qwen3ForCausalLM, hf_tok: PreTrainedTokenizerFast, n: int, seed: int
) -> dict[str, float]:
    """Greedy exact match per format, plus the arith gate's own measure.

    `<format>`: the whole completion, eos included, token for token. `arith_raw` and
    `arith_chat`: `arith.score` (text before ";") on `arith.make_problems(n, seed)` as a raw
    prompt and as one user message with the template's defaults, as `tandem eval` asks.
    """
    if n <= 0:
        return {}
    acc: dict[str, float] = {}
    for fmt, samples in held_out_samples(n, seed).items():
        targets = [hf_tok(s.completion, add_special_tokens=False)["input_ids"] for s in samples]
        got = generate(model, hf_tok, [s.prompt for s in samples], max(map(len, targets)) + 4)
        acc[fmt.value] = sum(g == t for g, t in zip(got, targets, strict=True)) / n
    problems = arith.make_problems(n, seed)
    for name, prompts in (
        ("arith_raw", [p.prompt for p in problems]),
        ("arith_chat", [
            hf_tok.apply_chat_template(
                [{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True
            )
            for p in problems
        ]),
    ):
        texts = hf_tok.batch_decode(
            generate(model, hf_tok, prompts, arith.ANSWER_MAX_TOKENS), skip_special_tokens=True
        )
        acc[name] = sum(map(arith.score, problems, texts)) / n
    return acc


def format_table(acc: dict[str, float]) -> str:
    return "greedy accuracy on held-out samples: " + "  ".join(
        f"{k} {v:.3f}" for k, v in acc.items()
    )
