"""Train the embedded model `models/tandem-arith` on the `arith` and `lookup` tasks, on CPU.

Steps: build a character-level tokenizer (the `tokenizers` library; every printable ASCII
character is a token, plus special tokens and the hermes / Qwen3 markers), build a
~1M-parameter Qwen3ForCausalLM from a config with transformers, train it on samples drawn on
the fly from training seeds (>= arith.TRAIN_SEED_MIN; evaluation seeds are below it), measure
held-out accuracy per format every `--eval-every-s` seconds, stop once every format reaches
`--target` or after `--minutes`, then measure greedy accuracy with `model.generate` on
held-out samples and save the checkpoint (safetensors + tokenizer files + generation config).

    .venv/bin/python models/train_arith.py --minutes 40 --out models/tandem-arith

The formats (models/chat_data.py): raw arith prompts as /v1/completions sends them, and chat
prompts rendered by the chat template (models/chat_template.jinja): arith as a user message,
with or without thinking and with or without the lookup tool on offer; lookup questions that
must be answered by tool calls; and the turn after the tool results. The loss covers only
the completion (the assignments are random: nothing to learn there).

Held-out accuracy during training is teacher-forced exact match (one forward pass per batch),
which equals greedy exact match. On a CPU shared with other busy processes, `--threads 1`
ran ~6x more steps per minute than 2 threads (OpenMP threads spin waiting for each other).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from chat_data import ARITH_MIX, MIX, TEMPLATE_PATH, SampleMaker  # first: puts the repo on sys.path
from measure import (
    Example,
    collate,
    encode,
    format_table,
    greedy_accuracy,
    held_out_samples,
    teacher_forced_accuracy,
)
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from orchestrator.tasks import arith

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, EOS, *ROLE_TOKENS)  # ids 0..5, in this order
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # printable ASCII + newline + tab
# The hermes / Qwen3 markers: one token each (ids 103..110), added but NOT special (as in
# Qwen3), so detokenizing with skip_special_tokens keeps them for the gateway's parsers.
MARKERS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<tools>", "</tools>",
)
MODEL_VOCAB_SIZE = 128  # 111 real tokens, padded up to a multiple of 64 for the embedding GEMM


def build_tokenizer() -> Tokenizer:
    """Character level: one token per character; characters outside the vocab map to <|unk|>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece (spaces and newlines included); added tokens match first.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join pieces with no separator
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    assert tok.get_vocab_size() <= MODEL_VOCAB_SIZE
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of the same tokenizer, carrying the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=TEMPLATE_PATH.read_text(),
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
        max_position_embeddings=512,  # the longest sample (tools + 25 assignments + a call) ~460
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        torch_dtype="float32",
    )
    return Qwen3ForCausalLM(config)


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
        chat_template=TEMPLATE_PATH.read_text(),
        bos_token=None,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def train_step(
    model: Qwen3ForCausalLM,
    opt: torch.optim.Optimizer,
    batch: list[Example],
    args: argparse.Namespace,
) -> float:
    """One optimizer step over `batch`, in length-sorted micro-batches (little padding)."""
    batch = sorted(batch, key=lambda e: len(e.ids))
    num_loss_tokens = sum(len(e.ids) - e.num_prompt_tokens for e in batch)
    size = math.ceil(len(batch) / args.micro_batches)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, len(batch), size):
        ids, labels = (t.to(args.device) for t in collate(batch[start : start + size]))
        with torch.autocast(
            torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16
        ):
            logits = model(input_ids=ids).logits  # [b, T, V]
        # Summed here and divided by the whole batch's count: the mean over all loss tokens.
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ) / num_loss_tokens
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total


def learning_rate(args: argparse.Namespace, step: int, elapsed_s: float) -> float:
    """Linear warm-up, then cosine decay to 0.1x over the time budget (steps/s varies on a
    shared CPU) or over --max-steps, whichever runs out first."""
    frac = min(max(elapsed_s / (args.minutes * 60), step / args.max_steps), 1.0)
    warm = min(1.0, (step + 1) / args.warmup)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    rng = random.Random(arith.TRAIN_SEED_MIN + args.seed)  # training seeds only
    tok = build_tokenizer()
    if args.init_from:  # a second stage: go on from a checkpoint (its own seed, its own stream)
        model = Qwen3ForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        model = model.to(args.device)
    else:
        model = build_model(args.seed, args.layers).to(args.device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    maker = SampleMaker(args.min_assignments)
    held_out = {
        fmt: [encode(tok, s) for s in samples]
        for fmt, samples in held_out_samples(args.eval_samples, args.eval_seed).items()
    }
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    t0 = last_eval = time.monotonic()
    step, loss_sum, loss_steps = 0, 0.0, 0
    history: list[dict[str, object]] = []
    warming = args.arith_first > 0  # phase 1: raw and chat arith only
    switched_at = 0
    while step < args.max_steps:
        elapsed = time.monotonic() - t0
        if elapsed > args.minutes * 60:
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step, elapsed)
        mix = ARITH_MIX if warming else MIX
        batch = [encode(tok, maker.draw(rng, mix=mix)) for _ in range(args.batch)]
        loss_sum += train_step(model, opt, batch, args)
        step += 1
        loss_steps += 1
        if (step % args.eval_every_steps == 0 if args.eval_every_steps
                else time.monotonic() - last_eval >= args.eval_every_s):
            acc = {fmt.value: teacher_forced_accuracy(model, ex)
                   for fmt, ex in held_out.items() if fmt in mix}
            last_eval = time.monotonic()
            print(
                f"{(last_eval - t0) / 60:5.1f} min  step {step:6d}  "
                f"loss {loss_sum / loss_steps:.4f}  held-out "
                + " ".join(f"{k} {v:.3f}" for k, v in acc.items()),
                flush=True,
            )
            history.append({"minutes": round((last_eval - t0) / 60, 2), "step": step, **acc})
            loss_sum, loss_steps = 0.0, 0
            if args.snapshot:  # a look at a long run's model while it trains (not the result)
                save(model, tok, Path(args.snapshot))
                model.to(args.device)
            if warming and min(acc.values()) >= args.arith_first:
                warming, switched_at = False, step
                print(f"arith at {args.arith_first}: every format from now on", flush=True)
            elif not warming and min(acc.values()) >= args.target:
                print(f"target {args.target} reached in every format", flush=True)
                break
    train_s = time.monotonic() - t0
    print(f"training: {step} steps in {train_s / 60:.1f} min", flush=True)
    hf_tok = wrap_tokenizer(tok)
    greedy = greedy_accuracy(model, hf_tok, args.final_eval, args.eval_seed)
    print(format_table(greedy), flush=True)
    save(model.to("cpu"), tok, Path(args.out))
    log = {
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        **{k: getattr(args, k) for k in ("batch", "micro_batches", "lr", "warmup", "bf16")},
        **{k: getattr(args, k) for k in ("device", "threads", "seed", "eval_seed", "layers")},
        "init_from": args.init_from,
        "min_assignments": args.min_assignments,
        "arith_first": args.arith_first,
        "all_formats_from_step": switched_at if args.arith_first > 0 else 0,
        "final_eval_samples": args.final_eval,
        "greedy_accuracy": greedy,  # per format: raw and chat arith, the lookup turns, thinking
        "accuracy_raw": greedy.get("arith_raw"),  # the arith gate's two prompt formats
        "accuracy_chat": greedy.get("arith_chat"),
        "held_out_history": history,  # teacher-forced, per format, at each evaluation
    }
    previous = Path(args.init_from) / "training_log.json" if args.init_from else None
    if previous is not None and previous.is_file():  # the stage this one went on from
        log["previous_stage"] = json.loads(previous.read_text())
    (Path(args.out) / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"saved to {args.out}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "tandem-arith"))
    p.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument(
        "--seed", type=int, default=1, help="training seed (offset from arith.TRAIN_SEED_MIN)"
    )
    p.add_argument(
        "--eval-seed", type=int, default=0, help="held-out seed (< arith.TRAIN_SEED_MIN)"
    )
    p.add_argument(
        "--init-from", default="", metavar="DIR",
        help="start from this checkpoint's weights instead of a fresh model (a second stage)",
    )
    p.add_argument(
        "--snapshot", default="", metavar="DIR",
        help="also save the model to DIR at every evaluation, to inspect a long run",
    )
    p.add_argument("--eval-samples", type=int, default=200, help="held-out samples per format")
    p.add_argument("--final-eval", type=int, default=200, help="greedy samples per format")
    p.add_argument("--eval-every-s", type=float, default=60.0)
    p.add_argument(
        "--eval-every-steps", type=int, default=0,
        help="evaluate (and maybe stop) every N steps instead: a run that stops at the same "
             "step whatever the machine's load (with --max-steps, the same weights)",
    )
    p.add_argument(
        "--target", type=float, default=0.995,
        help="stop once held-out accuracy reaches this in every format",
    )
    p.add_argument(
        "--batch", type=int, default=32, help="16 stalled for some seeds; 32 cleared on 3/3"
    )
    p.add_argument(
        "--micro-batches", type=int, default=2,
        help="split each length-sorted batch into this many forward passes (less padding)",
    )
    p.add_argument(
        "--arith-first", type=float, default=0.9,
        help="train on raw and chat arith alone until both reach this held-out accuracy, then "
             "on every format (0: every format from the start)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    p.add_argument(
        "--min-assignments", type=int, default=4, help="curriculum floor for training prompts"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True,
        help="bfloat16 autocast (weights stay float32)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu (the recipe) or cuda (for trying recipes fast)"
    )
    args = p.parse_args(argv)
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.eval_seed >= arith.TRAIN_SEED_MIN:
        p.error(f"--eval-seed must be < {arith.TRAIN_SEED_MIN} (larger seeds are training seeds)")
    if not 1 <= args.micro_batches <= args.batch:
        p.error(f"--micro-batches must be in [1, --batch], got {args.micro_batches}")
    return args


if __name__ == "__main__":
    train(parse_args())
