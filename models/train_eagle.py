"""Train an EAGLE head (speculative.method=eagle) for a dense Qwen3 / Llama checkpoint, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python models/train_eagle.py --minutes 6 \
        --target models/tandem-arith --out models/tandem-arith/eagle

The head is one decoder layer of the target's family over fc([embed(x_{t+1}) | h_t]), then a
norm; its logits are the target's LM head of that feature (worker/spec/heads.py `EagleHead`
runs the same math over paged KV). It is trained by self-distillation against the target's
*current* weights, so re-run this script whenever the target is retrained:

1. Data: `--pool` prompts in every format the target serves (models/eagle_prompts.py: arith
   raw and chat, with and without thinking, lookup tool calls and answers; training seeds only),
   rendered through the target's own chat template (transformers' apply_chat_template, so a
   changed template is followed); the target continues each greedily (`--new-tokens`). The
   head learns what the target emits.
2. Teacher: the target's final hidden states h_t (after its norm) and its next-token
   distribution at every position.
3. Training-time test (as EAGLE-3): `--steps` unrolled draft steps. Step 1 reads the true h_t;
   step s > 1 reads the head's own feature from step s - 1 at the position before (the feature
   extrapolation the engine does after the first draft), attending to step-1 keys up to t-s+1,
   then to the keys of steps 2..s on the diagonal: exactly the context a draft step sees at
   inference (catch-up KV below the first draft position, then the earlier drafts' KV).
   Loss per step: KL(target || head) on the next token + `--feature-weight` * smooth L1 between
   the head's feature and the target's h_{t+1}.
4. Saves config.json (`model_type: eagle`, the target's layer config, `target_fingerprint`),
   model.safetensors (`fc.weight`, `layers.0.*`, `norm.weight`) and training_log.json with the
   held-out agreement of each step's argmax with the target's (a proxy for acceptance), in
   all and per format.

`--layout mtp` trains the same way an MTP module in DeepSeek-V3's layout (enorm / hnorm before
`eh_proj`, the logits after `shared_head.norm`, no feature loss: its feature is the block's
un-normalized output) for `speculative.method=mtp` on a target without MTP layers; it is saved
with `model_type: mtp` to `<target>/mtp` by default.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.models.qwen3 import modeling_qwen3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from models.eagle_prompts import Format, render_prompts  # noqa: E402
from orchestrator.tasks import arith  # noqa: E402
from worker.model.loader import fingerprint, weight_files  # noqa: E402

NEG = float("-inf")


class TrainHead(nn.Module):
    """The head in transformers' modules, for training (names = the checkpoint's).

    layout "eagle": feature = norm(layer(fc([emb | h]))), logits = lm_head(feature).
    layout "mtp" (DeepSeek-V3's MTP module): feature = layer(eh_proj([enorm(emb) | hnorm(h)])),
    logits = lm_head(shared_head.norm(feature)).
    """

    def __init__(self, config: PretrainedConfig, layout: str = "eagle") -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layout = layout
        if layout == "mtp":
            self.enorm = modeling_qwen3.Qwen3RMSNorm(h, eps=eps)
            self.hnorm = modeling_qwen3.Qwen3RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = modeling_qwen3.Qwen3RMSNorm(h, eps=eps)
        else:
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.norm = modeling_qwen3.Qwen3RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([modeling_qwen3.Qwen3DecoderLayer(config, layer_idx=0)])
        self.rotary = modeling_qwen3.Qwen3RotaryEmbedding(config)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """emb, hidden [B, L, H], positions [1, L], mask [1, 1, L, L] additive → the features
        [B, L, H] (the next step's hidden input)."""
        if self.layout == "mtp":
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        else:
            x = self.fc(torch.cat([emb, hidden], dim=-1))
        cos_sin = self.rotary(x, positions)
        x = self.layers[0](x, attention_mask=mask, position_ids=positions,
                           position_embeddings=cos_sin)
        return x if self.layout == "mtp" else self.norm(x)  # type: ignore[no-any-return]

    def logits_input(self, feature: torch.Tensor) -> torch.Tensor:
        """What the target's LM head reads."""
        if self.layout == "mtp":
            return self.shared_head.norm(feature)  # type: ignore[no-any-return]
        return feature


def head_config(target: PretrainedConfig) -> PretrainedConfig:
    """The target's config for one layer (the head's decoder layer is the target's kind)."""
    cfg = type(target).from_dict(target.to_dict())
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    cfg._attn_implementation = "sdpa"
    return cfg


def ttt_mask(length: int, steps: int) -> torch.Tensor:
    """Additive mask [1, 1, S*L, S*L] over steps 1..S laid end to end (see the module doc)."""
    n = steps * length
    allowed = torch.zeros(n, n, dtype=torch.bool)
    t = torch.arange(length)
    causal = t[None, :] <= t[:, None]  # [L, L]
    allowed[:length, :length] = causal
    for s in range(1, steps):  # step s + 1 (0-based s): queries at rows s*L..
        rows = slice(s * length, (s + 1) * length)
        allowed[rows, :length] = t[None, :] <= t[:, None] - s  # step-1 keys up to t - s
        for r in range(1, s + 1):  # steps 2..s+1 on the diagonal, shifted by s - r
            cols = slice(r * length, (r + 1) * length)
            allowed[rows, cols] = t[None, :] == t[:, None] - (s - r)
    mask = torch.zeros(n, n)
    mask.masked_fill_(~allowed, NEG)
    return mask[None, None]


@torch.no_grad()
def continue_greedily(target: nn.Module, prompts: list[list[int]], new_tokens: int,
                      pad: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy continuation cut after its first eos, prompt length), in
    the order of `prompts`. Batches of similar prompt lengths, so that none runs past the
    target's context (`max_position_embeddings`) and little padding is computed."""
    eos = target.config.eos_token_id  # type: ignore[union-attr]
    context = target.config.max_position_embeddings  # type: ignore[union-attr]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    seqs: dict[int, tuple[list[int], int]] = {}
    for start in range(0, len(order), 64):
        rows = order[start : start + 64]
        chunk = [prompts[i] for i in rows]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(chunk):  # left padding: generation continues at the right edge
            ids[r, width - len(p) :] = torch.tensor(p)
            attn[r, width - len(p) :] = 1
        gen = target.generate(input_ids=ids, attention_mask=attn,  # type: ignore[operator]
                              max_new_tokens=min(new_tokens, context - width), do_sample=False,
                              pad_token_id=pad)
        for i, r_p in zip(rows, enumerate(chunk), strict=True):
            r, p = r_p
            tail = gen[r, width:].tolist()
            if eos in tail:
                tail = tail[: tail.index(eos) + 1]
            seqs[i] = (p + tail, len(p))
    return [seqs[i] for i in range(len(prompts))]


@torch.no_grad()
def teacher(target: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final hidden states [B, T, H] (after its norm) and log-probs [B, T, V]."""
    out = target.model(input_ids=ids)  # type: ignore[operator, union-attr]
    hidden = out.last_hidden_state
    return hidden, F.log_softmax(target.lm_head(hidden).float(), dim=-1)  # type: ignore[operator]


def step_losses(head: TrainHead, target: nn.Module, ids: torch.Tensor, lens: torch.Tensor,
                steps: int, feature_weight: float,
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Summed loss over the unrolled steps, and per step (argmax agreement [B, L], the
    positions it counts over [B, L])."""
    hidden, logp = teacher(target, ids)
    length = ids.shape[1] - 2  # positions t with x_{t+1} and x_{t+2} known
    emb = target.model.embed_tokens(ids[:, 1 : 1 + length])  # type: ignore[operator, union-attr]
    h_in = hidden[:, :length]
    want_logp = logp[:, 1 : 1 + length]  # the target's distribution for x_{t+2}
    want_feat = hidden[:, 1 : 1 + length]
    positions = torch.arange(length)[None]
    embs, hids, feats = [], [], []
    loss = torch.zeros(())
    agree = []
    for s in range(steps):
        if s == 0:
            h_s = h_in
        else:  # the previous step's feature at the position before (t - 1 predicts h_t)
            prev = feats[-1]
            h_s = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        embs.append(emb)
        hids.append(h_s)
        n = s + 1
        out = head(torch.cat(embs, 1), torch.cat(hids, 1), positions.repeat(1, n),
                   ttt_mask(length, n))
        f = out[:, s * length :]  # [B, L, H]: this step's queries
        feats.append(f)
        # Counted: positions with a feature before them (t >= s) inside the real sequence.
        pos = torch.arange(length)[None]
        valid = (pos >= s) & (pos < (lens - 2)[:, None])  # [B, L]
        logits = target.lm_head(head.logits_input(f)).float()  # type: ignore[operator]
        kl = F.kl_div(F.log_softmax(logits, -1), want_logp, log_target=True, reduction="none")
        kl = kl.sum(-1)[valid].mean()
        loss = loss + kl
        if head.layout == "eagle":  # its feature stands for the target's next hidden state
            loss = loss + feature_weight * F.smooth_l1_loss(f[valid], want_feat[valid])
        agree.append((logits.argmax(-1) == want_logp.argmax(-1), valid))
    return loss, agree


def save(head: TrainHead, target_dir: Path, out: Path, log: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    arch = "EagleHead" if head.layout == "eagle" else "MTPHead"
    cfg.update(architectures=[arch], model_type=head.layout, num_hidden_layers=1,
               layer_types=["full_attention"], target_architecture=cfg["architectures"][0],
               target_fingerprint=fingerprint(target_dir, weight_files(target_dir)))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()
               if not k.startswith("rotary.")}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")


def random_head(target_dir: Path, out: Path, seed: int = 0, layout: str = "eagle") -> TrainHead:
    """An untrained head for `target_dir`, saved in the engine's format (tests: any target)."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    head = TrainHead(head_config(AutoConfig.from_pretrained(target_dir)), layout)
    save(head, target_dir, out, {"steps": 0, "note": "random weights"})
    return head


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target_dir = Path(args.target)
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    pad = tok.pad_token_id or 0
    t0 = time.monotonic()
    pool = render_prompts(tok, args.pool, arith.TRAIN_SEED_MIN + 7)
    seqs = continue_greedily(target, [ids for _, ids in pool], args.new_tokens, pad)
    seqs.sort(key=lambda s: len(s[0]))  # batches of similar lengths: little padding
    evals = render_prompts(tok, args.eval, 3)
    held = continue_greedily(target, [ids for _, ids in evals], args.new_tokens, pad)
    print(f"data: {len(seqs)} sequences in {time.monotonic() - t0:.0f} s", flush=True)
    head = TrainHead(head_config(target.config), args.layout)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    budget, start, step = args.minutes * 60, time.monotonic(), 0
    rng = random.Random(args.seed)
    while time.monotonic() - start < budget and step < args.max_steps:
        frac = (time.monotonic() - start) / budget
        for g in opt.param_groups:
            warm = min(1.0, (step + 1) / 50)
            g["lr"] = args.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        near = rng.randrange(len(seqs) - 4 * args.batch + 1)  # a window of similar lengths
        batch = rng.sample(seqs[near : near + 4 * args.batch], args.batch)
        ids, lens = pad_batch([s for s, _ in batch], pad)
        loss, _ = step_losses(head, target, ids, lens, args.steps, args.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"{(time.monotonic() - start) / 60:4.1f} min step {step} loss {loss.item():.3f}",
                  flush=True)
    agree = evaluate(head, target, held, pad, args.steps)
    print("held-out agreement with the target's argmax per draft step: "
          + " ".join(f"{a:.3f}" for a in agree), flush=True)
    per_format = {}
    for fmt in Format:
        mine = [s for (f, _), s in zip(evals, held, strict=True) if f is fmt]
        if mine:
            per_format[fmt.value] = evaluate(head, target, mine, pad, args.steps)
            print(f"  {fmt.value} ({len(mine)}): "
                  + " ".join(f"{a:.3f}" for a in per_format[fmt.value]), flush=True)
    save(head, target_dir, Path(args.out), {
        "steps": step, "minutes": round((time.monotonic() - start) / 60, 2), "batch": args.batch,
        "lr": args.lr, "draft_steps_trained": args.steps, "pool": args.pool,
        "layout": args.layout,
        "new_tokens": args.new_tokens, "threads": args.threads, "eval_prompts": args.eval,
        "held_out_agreement_per_step": agree, "held_out_agreement_per_format": per_format,
        "seed": args.seed,
    })
    print(f"saved to {args.out}", flush=True)


def pad_batch(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and the lengths [B]: padding sits after each sequence, so the
    causal positions before it are untouched, and the losses skip it."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in batch])


@torch.no_grad()
def evaluate(head: TrainHead, target: nn.Module, seqs: list[tuple[list[int], int]], pad: int,
             steps: int) -> list[float]:
    """Per unrolled step: the share of the target's output positions (where drafts are
    verified) at which the head's argmax is the target's."""
    head.eval()
    hits = [0.0] * steps
    total = [0] * steps
    for seq, num_prompt in seqs:
        ids, lens = pad_batch([seq], pad)
        _, agree = step_losses(head, target, ids, lens, steps, 0.0)
        for i, (a, valid) in enumerate(agree):
            answer = valid & (torch.arange(a.shape[1])[None] >= num_prompt - 2)
            hits[i] += float(a[answer].sum())
            total[i] += int(answer.sum())
    head.train()
    return [round(h / max(n, 1), 4) for h, n in zip(hits, total, strict=True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(here / "tandem-arith"))
    p.add_argument("--out", default=str(here / "tandem-arith" / "eagle"))
    p.add_argument("--minutes", type=float, default=6.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=10**9)
    p.add_argument("--pool", type=int, default=2000, help="prompts the target continues")
    p.add_argument("--eval", type=int, default=100, help="held-out prompts (evaluation seeds)")
    p.add_argument("--new-tokens", type=int, default=160,
                   help="greedy continuation length (three tool calls and a think block)")
    p.add_argument("--steps", type=int, default=3, help="unrolled draft steps per position")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--feature-weight", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1,
                   help="1 ran 5-10x faster than 2 on a CPU shared with busy processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=("eagle", "mtp"), default="eagle",
                   help="eagle (speculative.method=eagle) or an MTP module in DeepSeek-V3's "
                        "layout for a target without one (speculative.method=mtp)")
    args = p.parse_args(argv)
    if args.layout == "mtp" and args.out == p.get_default("out"):
        args.out = str(Path(args.target) / "mtp")
    return args


if __name__ == "__main__":
    train(parse_args())
