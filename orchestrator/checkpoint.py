"""Pre-flight checks of the model in the launcher, before any worker starts (no torch import).

A checkpoint problem found by a worker ends in its log, after the cluster started and tore
down again; found here it is one line that names the file and the field and says what to do:

1. model.path: a directory, or a Hugging Face name in the local cache (orchestrator/hub.py).
2. config.json: valid JSON, a supported architecture, the fields every family needs, as
   integers; then the family's own parser, the one the worker runs (worker/arch: activation,
   rope, head layout, experts, quantization_config, ...).
3. Weights (unless `load_format: dummy`): `model.safetensors`, or the shards
   `model.safetensors.index.json` lists, each with a readable safetensors header whose tensors
   fill the file (a copy cut short is named); a model drafter's weights too.
4. Tokenizer: `tokenizer.json` readable by the tokenizers library, `tokenizer_config.json`
   valid JSON. A checkpoint with no tokenizer files at all is served in token-id mode (the
   gateway takes token-id prompts on /v1/completions and answers text prompts with a 400);
   one with a slow tokenizer's files but no `tokenizer.json` is refused, with the command that
   writes one.

The worker checks the same things again while loading (worker/model/loader.py).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import REPO_ROOT, ClusterConfig, ClusterConfigError
from orchestrator.hub import HubModelError, looks_like_repo_id, resolve_repo_id
from worker.arch import drafter
from worker.arch.hf_config import SUPPORTED_ARCHITECTURES, ArchConfig, ModelLoadError
from worker.arch.hf_defaults import with_absent_defaults
from worker.arch.load import load_arch_config
from worker.arch.safetensors_file import weight_files
from worker.config import ConfigError

# Fields every supported family reads from config.json (as integers).
REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                   "intermediate_size")
# Fields some families read, and the layout rules size pages from, when present (null = absent).
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# A slow (Python) tokenizer's files: transformers can convert them to tokenizer.json.
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


class CheckpointError(ClusterConfigError):
    """The checkpoint cannot be served; the message names the file and field and the fix."""


@dataclass(frozen=True)
class CheckpointReport:
    """What the checks found that the launcher tells the user."""

    path: Path
    config: dict[str, Any]  # config.json
    arch: ArchConfig  # config.json as the worker's family parser reads it
    has_tokenizer: bool  # False: token-id mode (no tokenizer files at all)


def model_dir(path: str) -> Path:
    """The checkpoint directory `model.path` names; CheckpointError saying where it looked."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    local = _local_parent(p)  # `models/tandem-arth`: a directory meant, not an ORG/NAME
    if not p.is_absolute() and looks_like_repo_id(path) and local is None:
        try:
            return resolve_repo_id(path)
        except HubModelError as exc:
            raise CheckpointError(f"model.path: {exc}") from None
    close = ""
    if local is not None:
        have = [d.name for d in local.iterdir() if (d / "config.json").is_file()]
        near = difflib.get_close_matches(p.name, have, n=1)
        close = f"did you mean {p.parent / near[0]}? " if near else ""
    raise CheckpointError(f"model.path: {p / 'config.json'} not found ({p} is not a "
                          f"directory); {close}point model.path (or --model) at an HF-format "
                          "checkpoint directory (config.json, *.safetensors, tokenizer.json) or "
                          "name one in the Hugging Face cache as ORG/NAME")


def _local_parent(p: Path) -> Path | None:
    """The directory that holds `p` where a relative model.path is looked up (the current
    directory, else the repository), when it is there; None for an absolute path."""
    if p.is_absolute():
        return p.parent if p.parent.is_dir() else None
    for root in (Path.cwd(), REPO_ROOT):
        if (root / p.parent).is_dir() and p.parent != Path("."):
            return root / p.parent
    return None


def read_json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"model.path: {path} not found; {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); re-download or re-save it") \
            from None


def read_config_json(file: Path, required: tuple[str, ...] = REQUIRED_FIELDS) -> dict[str, Any]:
    """config.json as a JSON object whose integer fields (REQUIRED_FIELDS + OPTIONAL_FIELDS)
    are positive integers where present; those in `required` must be (`tandem plan` asks only
    for what its page sizes read, so a shape-only config.json plans)."""
    cfg = read_json_file(file, "point model.path (or --model) at an HF-format directory")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: the top level must be a JSON object")
    cfg = with_absent_defaults(cfg)  # what the worker reads: transformers' absent-field defaults
    for key in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS):
        value = cfg.get(key)
        if value is None:
            if key in required:
                raise CheckpointError(f"{file}: required field {key!r} is missing; is this a "
                                      "decoder-only HF checkpoint's config.json?")
        elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{file}: {key} must be a positive integer, got {value!r}")
    return cfg


def check_config(path: Path) -> dict[str, Any]:
    """config.json: JSON object, supported architecture, required integer fields."""
    file = path / "config.json"
    cfg = read_config_json(file)
    _check_architectures(file, cfg)
    return cfg


def _check_architectures(file: Path, cfg: dict[str, Any]) -> None:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{file}: architectures must be a list of strings, got {archs!r} "
                              f"(e.g. [\"{SUPPORTED_ARCHITECTURES[0]}\"])")
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise CheckpointError(f"{file}: architectures={archs!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def check_weights(path: Path) -> list[Path]:
    """The safetensors files the worker will read (single file, index with shards, or any),
    each with a header whose tensors fill the file (worker/arch/safetensors_file.py: a file cut
    short is named here)."""
    try:
        return weight_files(path)
    except ModelLoadError as exc:
        raise CheckpointError(str(exc)) from None


def check_tokenizer(path: Path) -> bool:
    """True when the gateway can load a tokenizer; False when there are no tokenizer files."""
    tok = path / "tokenizer.json"
    if not tok.is_file():
        slow = [n for n in _SLOW_TOKENIZER_FILES if (path / n).is_file()]
        if slow:
            raise CheckpointError(
                f"{path}: has {slow[0]} but no tokenizer.json, which the gateway reads; write "
                f"one with `python -c \"from transformers import AutoTokenizer; "
                f"AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')\"`, or "
                "remove the tokenizer files to serve token-id prompts only")
        return False
    from tokenizers import Tokenizer  # a light import; the gateway loads the same file

    try:
        Tokenizer.from_file(str(tok))
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{tok}: the tokenizers library cannot read it ({first}); "
                              "re-download it or re-save the tokenizer with transformers' "
                              "save_pretrained") from None
    cfg = path / "tokenizer_config.json"
    config = read_json_file(cfg, "") if cfg.is_file() else {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg}: the top level must be a JSON object")
    check_chat_template(path)
    return True


def check_chat_template(path: Path) -> None:
    """The tokenizer and its chat template loaded as the gateway loads them (sandboxed jinja2
    with its extensions): a syntax error is one line naming the file here, before the launch."""
    from gateway.tokenizer import Tokenizer as GatewayTokenizer
    from gateway.tokenizer import TokenizerLoadError

    try:
        GatewayTokenizer.from_dir(path)
    except TokenizerLoadError as exc:
        raise CheckpointError(str(exc)) from None


def check_arch(path: Path) -> ArchConfig:
    """config.json through the family's parser, as the worker will read it: an unsupported
    activation, rope type, head layout or quantization_config is one line here rather than a
    worker's exit after the launch."""
    try:
        return load_arch_config(path)
    except ModelLoadError as exc:
        raise CheckpointError(str(exc)) from None


def check_checkpoint(model_path: str, load_format: str = "auto") -> CheckpointReport:
    """Every check above, in order; CheckpointError at the first problem."""
    path = model_dir(model_path)
    cfg = check_config(path)
    arch = check_arch(path)
    if load_format != "dummy":
        check_weights(path)
    return CheckpointReport(path, cfg, arch, check_tokenizer(path))


def check_for_plan(path: Path, cfg: dict[str, Any],
                   load_format: str = "auto") -> ArchConfig | None:
    """What `tandem plan` checks of a checkpoint directory whose config.json it read (`cfg`):
    serve's checks, except that a shape-only directory still plans: a config.json that names
    no architectures is shapes only (None: no family parser ran), and weights and tokenizer
    are checked where the directory has any."""
    if not cfg.get("architectures"):
        return None
    _check_architectures(path / "config.json", cfg)
    arch = check_arch(path)
    weights = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
    if load_format != "dummy" and (any(p.suffix in weights for p in path.iterdir())
                                   or (path / "model.safetensors.index.json").is_file()):
        check_weights(path)
    check_tokenizer(path)
    return arch


def check_drafter(cluster: ClusterConfig, path: Path, arch: ArchConfig) -> None:
    """A model drafter (`speculative.method` draft | eagle | mtp) checked against the target
    as the worker will check it (worker/arch/drafter.py): a missing or mismatched head is one
    line here rather than a worker's exit."""
    spec = cluster.speculative
    dp = max((rc.parallel.dp_size for _, rc in cluster.roles.present()), default=1)
    head = Path(spec.drafter_path(str(path)))
    try:
        drafter.check_drafter(spec.method, arch, path, head,
                              cluster.model.context_len(arch.context_limit), dp)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    own_layers = spec.method == "mtp" and drafter.own_mtp_layers(arch)
    if own_layers and cluster.model.load_format != "dummy":
        try:  # declared in config.json, but are they in the weights?
            drafter.check_mtp_weights(arch, path)
        except (ConfigError, ModelLoadError) as exc:
            raise CheckpointError(str(exc)) from None
    if spec.method in drafter.MODEL_METHODS and not own_layers \
            and cluster.model.load_format != "dummy":
        check_weights(head)  # a head cut short: here, not in a worker's traceback
