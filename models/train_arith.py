"""Train the embedded model `models/tandem-arith` on the `arith` task family, on CPU.

Steps: build a character-level tokenizer (the `tokenizers` library; every printable ASCII
character is a token, plus special tokens), build a ~1M-parameter Qwen3ForCausalLM from a
config with transformers, train it on problems drawn on the fly from training seeds
(>= arith.TRAIN_SEED_MIN; evaluation seeds are below it), measure held-out accuracy every
`--eval-every-s` seconds, stop at `--target` or after `--minutes`, then measure greedy
exact-match accuracy with `model.generate` on `--final-eval` held-out problems and save the
checkpoint (safetensors + tokenizer files + generation config).

    .venv/bin/python models/train_arith.py --minutes 25 --out models/tandem-arith

Each training sequence is one problem in one of three prompt formats, so the model answers
both a raw `/v1/completions` prompt and a chat-templated one:
    raw:         <prompt><answer>;<eos>
    chat:        <|user|><prompt><eos><|assistant|><answer>;<eos>
    chat+system: <|system|><text><eos><|user|><prompt><eos><|assistant|><answer>;<eos>
The loss covers only the answer, ";" and eos (the assignments are random: nothing to learn).

Held-out accuracy during training is teacher-forced exact match (one forward pass per batch),
which equals greedy exact match. On a CPU shared with other busy processes, `--threads 1`
ran ~6x more steps per minute than 2 threads (OpenMP threads spin waiting for each other).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from orchestrator.tasks import arith  # noqa: E402

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, EOS, *ROLE_TOKENS)  # ids 0..5, in this order
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # printable ASCII + newline + tab
MODEL_VOCAB_SIZE = 128  # 103 real tokens, padded up to a multiple of 64 for the embedding GEMM

# Jinja: each message is <|role|>content<eos>; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|endoftext|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer with the values.",
    "Be brief.",
)


def build_tokenizer() -> Tokenizer:
    """Character-level: one token per character; characters outside the vocab map to <|unk|>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece (spaces and newlines included); specials match first.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join pieces with no separator
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of the same tokenizer, carrying the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_model(seed: int, num_layers: int = 4) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, so the engine's grouped-head path is exercised
        head_dim=32,
        max_position_embeddings=512,  # prompts are <= ~190 tokens even with a system message
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        torch_dtype="float32",
    )
    return Qwen3ForCausalLM(config)


@dataclass
class Example:
    ids: list[int]  # prompt + answer + ";" + eos
    num_prompt_tokens: int  # the loss starts here


def format_prompt(prompt: str, fmt: str, system: str = "") -> str:
    if fmt == "raw":
        return prompt
    head = f"<|system|>{system}{EOS}" if fmt == "system" else ""
    return f"{head}<|user|>{prompt}{EOS}<|assistant|>"


def make_example(tok: Tokenizer, rng: random.Random, min_assignments: int) -> Example:
    problem = arith.make_problem(rng, rng.randint(min_assignments, arith.MAX_ASSIGNMENTS))
    fmt = rng.choices(("raw", "chat", "system"), weights=(0.45, 0.4, 0.15))[0]
    prompt_ids = tok.encode(format_prompt(problem.prompt, fmt, rng.choice(SYSTEM_PROMPTS))).ids
    answer_ids = tok.encode(problem.answer + arith.STOP + EOS).ids
    return Example(ids=prompt_ids + answer_ids, num_prompt_tokens=len(prompt_ids))


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


@torch.no_grad()
def teacher_forced_accuracy(model: Qwen3ForCausalLM, examples: list[Example]) -> float:
    """Share of examples whose every answer token is the argmax given the gold prefix.

    Equal to greedy exact-match accuracy (greedy reproduces the answer iff each step's argmax
    is the gold token), at one forward pass per batch instead of one per generated token.
    """
    model.eval()
    right = 0
    for start in range(0, len(examples), 100):
        ids, labels = (t.to(model.device) for t in collate(examples[start : start + 100]))
        pred = model(input_ids=ids).logits.argmax(-1)  # [B, T]
        mask = labels != -100
        right += int(((pred == labels) | ~mask).all(dim=1).sum())
    model.train()
    return right / len(examples)


@torch.no_grad()
def generate_accuracy(
    model: Qwen3ForCausalLM,
    hf_tok: PreTrainedTokenizerFast,
    problems: list[arith.Problem],
    chat: bool,
) -> float:
    """Greedy exact match with transformers `generate`, scored by `arith.score`."""
    if not problems:
        return float("nan")
    model.eval()
    hf_tok.padding_side = "left"  # generation continues from the right edge
    right = 0
    for start in range(0, len(problems), 50):
        chunk = problems[start : start + 50]
        texts = [format_prompt(p.prompt, "chat" if chat else "raw") for p in chunk]
        enc = hf_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(
            model.device
        )
        out = model.generate(
            **enc,
            max_new_tokens=arith.ANSWER_MAX_TOKENS,
            do_sample=False,
            pad_token_id=hf_tok.pad_token_id,
        )
        completions = hf_tok.batch_decode(
            out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True
        )
        right += sum(arith.score(p, c) for p, c in zip(chunk, completions, strict=True))
    model.train()
    return right / len(problems)


def held_out_examples(tok: Tokenizer, n: int, seed: int) -> list[Example]:
    """Evaluation-seed problems (seed < TRAIN_SEED_MIN), alternating raw and chat format."""
    out = []
    for i, p in enumerate(arith.make_problems(n, seed)):
        prompt_ids = tok.encode(format_prompt(p.prompt, "chat" if i % 2 else "raw")).ids
        out.append(
            Example(prompt_ids + tok.encode(p.answer + arith.STOP + EOS).ids, len(prompt_ids))
        )
    return out


def save(model: Qwen3ForCausalLM, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # Readers that predate transformers 5 look for `torch_dtype` and a top-level `rope_theta`.
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config.get("dtype", "float32")
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    wrap_tokenizer(tok).save_pretrained(out)
    # The gateway reads tokenizer.json with the plain `tokenizers` library: save it from there too.
    tok.save(str(out / "tokenizer.json"))
    # One home for the chat template, inside tokenizer_config.json, where the gateway reads it;
    # the class name that transformers 4 and 5 both resolve.
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.seed < 0:
        raise SystemExit(f"--seed must be >= 0, got {args.seed}")
    rng = random.Random(arith.TRAIN_SEED_MIN + args.seed)  # training seeds only
    tok = build_tokenizer()
    model = build_model(args.seed, args.layers).to(args.device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    held_out = held_out_examples(tok, args.eval_samples, args.eval_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    budget_s = args.minutes * 60
    t0 = last_eval = time.monotonic()
    step, loss_sum, loss_steps = 0, 0.0, 0
    while step < args.max_steps:
        elapsed = time.monotonic() - t0
        if elapsed > budget_s:
            break
        # Linear warm-up, then cosine decay over the time budget (steps/s varies on a shared
        # CPU) or over --max-steps, whichever runs out first.
        frac = min(max(elapsed / budget_s, step / args.max_steps), 1.0)
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        batch = [make_example(tok, rng, args.min_assignments) for _ in range(args.batch)]
        ids, labels = (t.to(args.device) for t in collate(batch))
        with torch.autocast(
            torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16
        ):
            logits = model(input_ids=ids).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_sum += loss.item()
        loss_steps += 1
        if time.monotonic() - last_eval >= args.eval_every_s:
            acc = teacher_forced_accuracy(model, held_out)
            last_eval = time.monotonic()
            print(
                f"{(last_eval - t0) / 60:5.1f} min  step {step:6d}  lr {lr:.2e}  "
                f"answer loss {loss_sum / loss_steps:.4f}  held-out acc {acc:.3f}",
                flush=True,
            )
            loss_sum, loss_steps = 0.0, 0
            if acc >= args.target:
                print(f"target {args.target} reached", flush=True)
                break
    train_s = time.monotonic() - t0
    print(f"training: {step} steps in {train_s / 60:.1f} min", flush=True)
    hf_tok = wrap_tokenizer(tok)
    problems = arith.make_problems(args.final_eval, args.eval_seed)
    raw = generate_accuracy(model, hf_tok, problems, chat=False)
    chat = generate_accuracy(model, hf_tok, problems, chat=True)
    print(
        f"greedy generate accuracy on {len(problems)} held-out problems: raw {raw:.3f}  chat {chat:.3f}",
        flush=True,
    )
    save(model.to("cpu"), tok, Path(args.out))
    (Path(args.out) / "training_log.json").write_text(
        json.dumps(
            {
                "steps": step,
                "train_minutes": round(train_s / 60, 2),
                "batch": args.batch,
                "lr": args.lr,
                "warmup": args.warmup,
                "bf16": args.bf16,
                "device": args.device,
                "threads": args.threads,
                "seed": args.seed,
                "eval_seed": args.eval_seed,
                "final_eval_problems": len(problems),
                "accuracy_raw": raw,
                "accuracy_chat": chat,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"saved to {args.out}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "tandem-arith"))
    p.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument(
        "--seed", type=int, default=1, help="training seed (offset from arith.TRAIN_SEED_MIN)"
    )
    p.add_argument(
        "--eval-seed", type=int, default=0, help="held-out seed (< arith.TRAIN_SEED_MIN)"
    )
    p.add_argument("--eval-samples", type=int, default=500)
    p.add_argument("--final-eval", type=int, default=500)
    p.add_argument("--eval-every-s", type=float, default=60.0)
    p.add_argument(
        "--target", type=float, default=0.995, help="stop once held-out accuracy reaches this"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="16 stalled for some seeds; 32 cleared the target on 3/3",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    p.add_argument(
        "--min-assignments", type=int, default=4, help="curriculum floor for training prompts"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bfloat16 autocast (weights stay float32)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu (the recipe) or cuda (for trying recipes fast)"
    )
    args = p.parse_args(argv)
    if args.eval_seed >= arith.TRAIN_SEED_MIN:
        p.error(f"--eval-seed must be < {arith.TRAIN_SEED_MIN} (larger seeds are training seeds)")
    return args


if __name__ == "__main__":
    train(parse_args())
