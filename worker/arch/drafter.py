"""A model drafter (`speculative.method` draft | eagle | mtp) checked against its target from
the two config.json files (and tokenizer.json files) alone, without torch: the worker runs it
before it loads the head (worker/spec/load.py), the launcher and `tandem plan` before any
process starts (orchestrator/checkpoint.py), so a drafter that cannot serve is one line there.

What a drafter must match (its KV lives in the target's pages, its ids are verified by the
target): the KV head count and head dim; for a head fed the target's hidden state (eagle, a
side-trained mtp module) also the hidden size and vocabulary; for a draft model the vocabulary,
a context at least the target's, and the target's token ids. What needs the loaded weights
(the head's tensors, the dtype the target runs in) stays in the worker.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.arch.field_types import check_field_types
from worker.arch.hf_config import ArchConfig, ModelLoadError, parse_arch_config
from worker.arch.load import load_arch_config, read_json
from worker.arch.safetensors_file import read_header, weight_files
from worker.config import ConfigError

MODEL_METHODS = ("draft", "eagle", "mtp")
# The dense families an EAGLE / MTP head is built for (one decoder layer of the target's kind),
# and the families a draft model may be (full attention, K/V heads).
EAGLE_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def own_mtp_layers(target: ArchConfig) -> int:
    """The MTP layers the target's config.json declares (DeepSeek-V3's
    num_nextn_predict_layers, Qwen3-Next's mtp_num_hidden_layers); 0 for other families."""
    return int(getattr(target.family, "num_mtp_layers", 0) or 0)


def check_drafter(method: str, target: ArchConfig, target_dir: Path, drafter_dir: Path,
                  max_len: int, dp_size: int = 1) -> None:
    """ConfigError naming the field and the fix when the drafter cannot serve this target;
    nothing for ngram / none. `max_len`: the context a request may reach."""
    if method not in MODEL_METHODS:
        return
    if dp_size > 1:
        raise ConfigError(f"speculative.method={method} cannot run with parallel.dp_size="
                          f"{dp_size} (attention DP steps no drafter); set parallel.dp_size: 1 "
                          "or speculative.method: ngram")
    if method == "mtp" and own_mtp_layers(target):
        # The checkpoint's own MTP layer drafts (the worker checks its tensors are there): a
        # module named beside it would be ignored, so it is refused rather than never run.
        if drafter_dir != target_dir / "mtp":
            raise ConfigError(
                f"speculative.model: {drafter_dir} is set, but {target_dir} "
                f"({target.architecture}) has MTP layers of its own, which speculative.method=mtp "
                "runs; unset speculative.model, or set speculative.method to that drafter's "
                "(eagle | draft)")
        return
    source = drafter_dir / "config.json"
    if not source.is_file():
        if method == "mtp":
            module = ("point speculative.model at an MTP module (models/train_eagle.py --layout "
                      "mtp writes one), or " if target.architecture in EAGLE_TARGETS else "")
            raise ConfigError(
                f"speculative.model: {drafter_dir} has no config.json and {target_dir} "
                f"({target.architecture}) declares no MTP layer of its own (DeepSeek-V3 "
                f"num_nextn_predict_layers, Qwen3-Next mtp_num_hidden_layers); {module}use "
                f"speculative.method {_other_methods(target)}")
        fix = ("models/train_eagle.py writes one" if method == "eagle"
               else "an HF checkpoint with the target's token ids")
        raise ConfigError(f"speculative.model: {drafter_dir} has no config.json; point "
                          f"speculative.model at the {method} drafter's directory ({fix}), or "
                          "set speculative.method ngram or none")
    try:
        _check_method(method, source)
        if method == "draft":
            _check_draft(target, target_dir, drafter_dir, max_len)
        else:
            _check_head(method, target, source)
    except ModelLoadError as exc:
        raise ConfigError(f"speculative.model {str(drafter_dir)!r}: {exc}") from None


def _drafter_method(raw: dict[str, object]) -> str:
    """The method a drafter's config.json is for: eagle and mtp heads say so in model_type
    (models/train_eagle.py); anything else is a causal LM, a draft model."""
    kind = raw.get("model_type")
    return kind if kind in ("eagle", "mtp") else "draft"


def _check_method(method: str, source: Path) -> None:
    """A drafter directory of another method (the embedded model ships all three side by
    side): say which method it is for, before its fields are read as this method's."""
    raw = read_json(source)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{source}: the top level must be a JSON object")
    theirs = _drafter_method(raw)
    if theirs != method:
        wanted = "a draft model" if method == "draft" else f"an {method} head"
        what = f"an {theirs} head" if theirs != "draft" else "a causal LM, a draft model"
        raise ConfigError(f"speculative.model: {source} is not {wanted} (model_type "
                          f"{raw.get('model_type')!r}: {what}); set speculative.method="
                          f"{theirs}, or point speculative.model at {wanted}'s directory")


def _check_head(layout: str, target: ArchConfig, source: Path) -> None:
    """An EAGLE head or a side-trained MTP module (`layout`) for a dense target."""
    raw = read_json(source)
    if raw.get("model_type") != layout:
        raise ConfigError(f"speculative.model: {source} is not an {layout} head (model_type "
                          f"{raw.get('model_type')!r}, want {layout!r}); models/train_eagle.py "
                          f"--layout {layout} writes one")
    if target.architecture not in EAGLE_TARGETS:
        raise ConfigError(f"speculative.method={layout}: heads are built for "
                          f"{', '.join(EAGLE_TARGETS)}; {target.architecture} is not one; use "
                          "speculative.method ngram")
    check_field_types(raw, str(source))  # before the parser's int() and float()
    head = parse_arch_config({**raw, "architectures": [target.architecture]}, None, str(source))
    _check_geometry(source, target, hidden_size=head.hidden_size, vocab_size=head.vocab_size,
                    num_key_value_heads=head.num_kv_heads, head_dim=head.head_dim)


def _check_draft(target: ArchConfig, target_dir: Path, drafter_dir: Path, max_len: int) -> None:
    source = drafter_dir / "config.json"
    if target.kv_latent_dim:
        raise ConfigError(f"speculative.method=draft: {target.architecture} keeps MLA latent "
                          "pages, which a draft model's K/V cannot share; use speculative."
                          "method mtp")
    draft = load_arch_config(drafter_dir)
    if draft.architecture not in EAGLE_TARGETS:
        raise ConfigError(f"speculative.model {str(drafter_dir)!r}: {draft.architecture} is not "
                          f"a dense Llama / Qwen model ({', '.join(EAGLE_TARGETS)}), so it "
                          "cannot draft; use one of those")
    if any(w is not None for w in draft.layer_windows):
        raise ConfigError(f"speculative.model {str(drafter_dir)!r}: its sliding-window layers "
                          "cannot draft (a draft model's KV is every token's); use a dense "
                          "Llama / Qwen model without a window")
    _check_geometry(source, target, vocab_size=draft.vocab_size,
                    num_key_value_heads=draft.num_kv_heads, head_dim=draft.head_dim)
    if draft.context_limit and draft.context_limit < max_len:
        scaled = (f" ({draft.context_limit} with its RoPE scaling)"
                  if draft.context_limit != draft.max_position_embeddings else "")
        raise ConfigError(f"speculative.model: {source} max_position_embeddings "
                          f"{draft.max_position_embeddings}{scaled} < the target's context "
                          f"{max_len}; "
                          "lower model.max_model_len or train the draft longer")
    _check_tokenizer(drafter_dir, target_dir)


def check_mtp_weights(target: ArchConfig, target_dir: Path) -> None:
    """ConfigError when config.json declares MTP layers (own_mtp_layers) that the weights lack:
    transformers' save_pretrained of DeepSeek-V3 or Qwen3-Next keeps the count and writes none."""
    prefix = _mtp_prefix(target)
    if not any(name.startswith(prefix) for file in weight_files(target_dir)
               for name in read_header(file)):
        raise ConfigError(mtp_weights_missing(target, target_dir))


def mtp_weights_missing(target: ArchConfig, target_dir: Path | str) -> str:
    """The refusal of speculative.method=mtp on a checkpoint whose MTP layers are declared only."""
    field = ("mtp_num_hidden_layers" if target.architecture == "Qwen3NextForCausalLM"
             else "num_nextn_predict_layers")
    return (f"speculative.method=mtp: {target_dir} ({target.architecture}) declares "
            f"{field}={own_mtp_layers(target)} in config.json but its weights hold no "
            f"{_mtp_prefix(target)}* tensors (transformers' save_pretrained writes none); use a "
            f"checkpoint with its MTP weights, or speculative.method {_other_methods(target)}")


def _mtp_prefix(target: ArchConfig) -> str:
    """Where the target's own MTP layers' tensors are named (DeepSeek-V3: after the decoder)."""
    if target.architecture == "Qwen3NextForCausalLM":
        return "mtp."
    return f"model.layers.{target.num_layers}."


def _other_methods(target: ArchConfig) -> str:
    """The methods other than mtp that `target` can run, for a refusal's fix."""
    methods = [m for m, ok in (("eagle", target.architecture in EAGLE_TARGETS),
                               ("draft", not target.kv_latent_dim)) if ok]
    return f"{', '.join(methods)} or ngram" if methods else "ngram"


def _check_geometry(source: Path, target: ArchConfig, **theirs: int) -> None:
    """The drafter's KV shares the target's pages: its head count, head dim (and for a head
    fed the target's hidden state, its width and vocabulary) must equal the target's."""
    ours = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim}
    diffs = [f"{k} {v} != the target's {ours[k]}" for k, v in theirs.items() if v != ours[k]]
    if diffs:
        raise ConfigError(f"speculative.model: {source} cannot share the target's KV pages: "
                          f"{', '.join(diffs)}; train the drafter for this target")


def _check_tokenizer(draft: Path, target: Path) -> None:
    """A draft model proposes token ids that the target verifies, so every id the draft's
    tokenizer defines must mean the same text in the target's. The target may define more
    (tokens added after the draft was trained, e.g. the embedded model's <think> and
    <tool_call>): the draft never learnt them, which only costs acceptance where they occur."""
    mine, theirs = draft / "tokenizer.json", target / "tokenizer.json"
    if not (mine.is_file() and theirs.is_file()) or mine.read_bytes() == theirs.read_bytes():
        return
    ours, want = _id_texts(mine), _id_texts(theirs)
    wrong = [i for i, text in sorted(ours.items()) if want.get(i) != text]
    if wrong:
        i = wrong[0]
        raise ConfigError(f"speculative.model: {mine} maps {len(wrong)} token ids differently "
                          f"from the target's {theirs} (id {i}: {ours[i]!r} vs "
                          f"{want.get(i)!r}); a draft model must use the target's token ids")


def _id_texts(path: Path) -> dict[int, str]:
    """id -> token text of a tokenizers-library tokenizer.json (its model's vocabulary and
    its added tokens)."""
    try:
        data = json.loads(path.read_text())
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):  # WordLevel, BPE, WordPiece: token -> id
            out = {int(i): str(t) for t, i in vocab.items()}
        else:  # Unigram: [[piece, score], ...] in id order
            out = {i: str(piece[0]) for i, piece in enumerate(vocab)}
        out.update({int(t["id"]): str(t["content"]) for t in data.get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"speculative.model: {path} is not a readable tokenizer.json "
                          f"({exc}); give the draft model the target's tokenizer files") from None
    return out
