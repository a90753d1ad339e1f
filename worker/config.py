"""Configuration of one worker process: model, KV cache, scheduler, parallelism.

Frozen dataclasses, composed (never inherited). The orchestrator's cluster config embeds
these; a worker receives only its own `WorkerConfig`. Validation errors name the field and
the fix (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from protocol.tls import TLSConfig
from transfer.config import TransferConfig

Role = Literal["both", "prefill", "decode"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "dummy"]
# KV cache storage: auto = the model dtype; fp8_e4m3 = float8_e4m3fn pages with per-tensor or
# per-head K/V scales from the checkpoint (1.0 where it has none). See docs/config.md.
KVCacheDType = Literal["auto", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8_e4m3")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = "models/tandem-arith"  # HF-format directory (config.json, *.safetensors, tokenizer)
    served_model_name: str = ""  # "" = the directory's name
    dtype: DType = "auto"  # auto = the checkpoint's (arch/load.py config_dtype); fp16 on CPU: fp32
    load_format: LoadFormat = "auto"  # dummy = random weights at the checkpoint's real shapes
    max_model_len: int = 0  # 0 = the checkpoint's context (ModelSpec.max_position_embeddings)
    seed: int = 0  # seed for dummy weights
    enforce_eager: bool = False  # CUDA: no decode graphs (every step launches kernels one by one)
    # CUDA, dense models: steps with prefill chunks replay graphs around eager attention
    # (worker/piecewise.py), so the decode rows riding in them keep graph speed.
    piecewise_graphs: bool = True
    # Those of them that fit (up to 8 prompts or chunks of modest context) replay one graph of
    # the whole forward, attention included (worker/mixed_graphs.py); needs piecewise_graphs.
    mixed_graphs: bool = True

    def context_len(self, max_position_embeddings: int) -> int:
        """The context a request may reach: `max_model_len`, never past the checkpoint's
        `max_position_embeddings` (0 there: no limit from the checkpoint)."""
        limit = max_position_embeddings or 1 << 62
        return min(self.max_model_len or limit, limit)

    def validate(self, prefix: str = "model") -> None:
        if self.max_model_len < 0:
            raise ConfigError(f"{prefix}.max_model_len must be >= 0 (0 = from the checkpoint), "
                              f"got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # 0 = derive from max_total_tokens
    max_total_tokens: int = 65536  # KV capacity in tokens when num_pages is 0
    enable_prefix_cache: bool = True
    kv_cache_dtype: KVCacheDType = "auto"  # auto = the model dtype; fp8_e4m3 = 1 byte per element

    def validate(self, prefix: str = "cache") -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"{prefix}.kv_cache_dtype must be one of "
                              f"{'|'.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"{prefix}.page_size must be a positive power of two, "
                              f"got {self.page_size}")
        if self.num_pages < 0:
            raise ConfigError(f"{prefix}.num_pages must be >= 0 (0 = from max_total_tokens), "
                              f"got {self.num_pages}")
        if self.num_pages == 0 and self.max_total_tokens < self.page_size:
            raise ConfigError(f"{prefix}.max_total_tokens must hold at least one page "
                              f"({self.page_size} tokens), got {self.max_total_tokens}")

    @property
    def total_pages(self) -> int:
        return self.num_pages or self.max_total_tokens // self.page_size


Overlap = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # most requests in one running batch
    chunked_prefill_size: int = 512  # token budget of one step (prefill chunks + decodes)
    # The budget of a step while some request decodes (0 = chunked_prefill_size); decodes and
    # their drafts count, as in chunked_prefill_size. Every decode in a step waits for the
    # step's prompt chunks, so this bounds the ITL p99 under load; an idle worker still
    # prefills in chunked_prefill_size chunks. docs/config.md has figures.
    mixed_step_tokens: int = 0
    max_waiting: int = 4096  # queued requests beyond this are refused (RESOURCE_EXHAUSTED)
    # Overlapped decode: schedule and launch step N+1 before reading step N's tokens. auto = on
    # where the device runs asynchronously (CUDA); on a CPU it would only delay each token a step.
    overlap: Overlap = "auto"

    def validate(self, prefix: str = "scheduler") -> None:
        if self.overlap not in ("auto", "on", "off"):
            raise ConfigError(f"{prefix}.overlap must be auto, on or off, got {self.overlap!r}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"{prefix}.max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_waiting < 1:  # every request waits first: 0 would refuse them all
            raise ConfigError(f"{prefix}.max_waiting must be >= 1 (requests queued at most), "
                              f"got {self.max_waiting}")
        if self.chunked_prefill_size < self.max_num_seqs:
            raise ConfigError(
                f"{prefix}.chunked_prefill_size ({self.chunked_prefill_size}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode each step"
            )
        if self.mixed_step_tokens and not (
                self.max_num_seqs <= self.mixed_step_tokens <= self.chunked_prefill_size):
            raise ConfigError(
                f"{prefix}.mixed_step_tokens ({self.mixed_step_tokens}) must be 0 (off) or "
                f"between max_num_seqs ({self.max_num_seqs}) and chunked_prefill_size "
                f"({self.chunked_prefill_size})")

    def check_overlap(self, multi_rank: bool, speculative: bool,
                      prefix: str = "scheduler") -> None:
        """`overlap: on` where it cannot run: a multi-rank worker sends each step's input ids to
        its followers from the host (a PENDING id cannot travel there), and speculative
        decoding drafts from the tokens the last step accepted."""
        if self.overlap == "on" and multi_rank:
            raise ConfigError(f"{prefix}.overlap=on needs a single-rank worker (tp_size*dp_size "
                              "= 1); set it auto or off for multi-rank workers")
        if self.overlap == "on" and speculative:
            raise ConfigError(f"{prefix}.overlap=on cannot run with speculative decoding (each "
                              "step's drafts come from the tokens the last one accepted); set "
                              "it auto or off")

    def check_window(self, window: int, page_size: int) -> None:
        """A window model's bounded replay runs in one step: every step budget must hold the
        window and one page (window 0: no window group, nothing to check)."""
        budget = self.mixed_step_tokens or self.chunked_prefill_size  # the smaller one
        if window and budget < window + page_size:
            name = "mixed_step_tokens" if self.mixed_step_tokens else "chunked_prefill_size"
            raise ConfigError(
                f"scheduler.{name} ({budget}) must be at least the model's sliding window plus "
                f"one page ({window} + {page_size}) so a replayed window fits one step; raise it")


All2AllBackend = Literal["torch", "deepep"]


@dataclass(frozen=True)
class ParallelConfig:
    """How one worker's ranks are laid out (see docs/parallelism.md).

    A worker is `tp_size * dp_size` rank processes; attention is tensor-parallel inside a
    group of tp_size ranks and data-parallel across dp_size groups; MoE layers span all
    ranks, split by expert (ep_size = world) or by intermediate feature (ep_size = 1).
    """

    tp_size: int = 1
    tp_rank: int = 0  # this process's rank in its TP group (the worker's entry process is 0)
    # cpu | cuda | cuda:N. A cluster config's `auto` is resolved before it gets here
    # (orchestrator/devices.py: on the machine the worker runs on), so a worker never guesses.
    device: str = "cpu"
    # attention data-parallel groups: one scheduler and KV pool each (worker/dp_runner.py)
    dp_size: int = 1
    ep_size: int = 1  # MoE expert parallelism: 1 (experts TP-sharded) or tp_size * dp_size
    all2all_backend: All2AllBackend = "torch"  # MoE dispatch/combine: torch.distributed or DeepEP
    nnodes: int = 1  # nodes this worker's ranks span
    node_rank: int = 0  # which of them this process runs on (node 0 serves gRPC)
    # tcp://host:port of the rank-0 rendezvous; "" = a free local port (nnodes 1)
    dist_init_addr: str = ""

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    def validate(self, prefix: str = "parallel") -> None:
        dev = self.device
        if not (dev in ("cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(f"{prefix}.device must be cpu, cuda or cuda:N, got {dev!r} (a "
                              "cluster config's auto is resolved by the launcher)")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"{prefix}: need 0 <= tp_rank < tp_size, got rank {self.tp_rank} "
                              f"of {self.tp_size}")
        if self.dp_size <= 0:
            raise ConfigError(f"{prefix}.dp_size must be >= 1, got {self.dp_size}")
        if self.ep_size not in (1, self.world_size):
            raise ConfigError(f"{prefix}.ep_size must be 1 (MoE TP) or "
                              f"tp_size*dp_size={self.world_size} "
                              f"(one expert group over every rank), got {self.ep_size}")
        if self.all2all_backend not in ("torch", "deepep"):
            raise ConfigError(f"{prefix}.all2all_backend must be torch or deepep, "
                              f"got {self.all2all_backend!r}")
        if self.nnodes <= 0 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"{prefix}: need 0 <= node_rank < nnodes, got node {self.node_rank} "
                              f"of {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ConfigError(f"{prefix}: tp_size*dp_size={self.world_size} ranks must split "
                              f"evenly over nnodes={self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr.startswith("tcp://"):
            raise ConfigError(f"{prefix}.dist_init_addr must be tcp://HOST:PORT (node 0's "
                              f"address) when nnodes > 1, got {self.dist_init_addr!r}")


SpecMethod = Literal["none", "ngram", "draft", "eagle", "mtp"]
SPEC_METHODS: tuple[str, ...] = ("none", "ngram", "draft", "eagle", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (worker/spec/): a drafter proposes up to num_speculative_tokens
    tokens per decode step and the target verifies them in one forward. Decode and mono workers
    draft; a prefill worker ships what the decode side's drafter needs (docs/speculative.md)."""

    method: SpecMethod = "none"  # none | ngram (prompt lookup) | draft | eagle | mtp
    num_speculative_tokens: int = 3  # drafts per step at most
    ngram_min: int = 1  # prompt lookup: the shortest n-gram matched
    ngram_max: int = 4  # ... and the longest (tried first)
    # draft | eagle: the drafter's HF-format directory; "" = <model.path>/<method> (the embedded
    # model ships models/tandem-arith/{eagle,draft,mtp}). mtp reads the target checkpoint's own
    # MTP layers; a dense target without any takes an MTP module from here (<model.path>/mtp).
    model: str = ""

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self, prefix: str = "speculative") -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"{prefix}.method must be one of {' | '.join(SPEC_METHODS)}, "
                              f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"{prefix}.num_speculative_tokens must be in [1, 16], "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"{prefix}: need 1 <= ngram_min <= ngram_max, got "
                              f"{self.ngram_min} and {self.ngram_max}")
        self._check_unread(prefix)
        if self.model and self.method not in ("draft", "eagle", "mtp"):
            raise ConfigError(f"{prefix}.model is the checkpoint of a model drafter, but "
                              f"{prefix}.method is {self.method}: set {prefix}.method to the "
                              f"drafter's (draft | eagle | mtp), or unset {prefix}.model")

    def _check_unread(self, prefix: str) -> None:
        """A knob set away from its default that the method never reads is refused: it would
        be dropped silently (num_speculative_tokens with method none serves no drafts at all;
        vLLM refuses it too). A default value cannot be told from an unset one, so it passes."""
        readers = {"num_speculative_tokens": SPEC_METHODS[1:], "ngram_min": ("ngram",),
                   "ngram_max": ("ngram",)}
        for f in dataclasses.fields(self):
            if (f.name in readers and self.method not in readers[f.name]
                    and getattr(self, f.name) != f.default):
                raise ConfigError(f"{prefix}.{f.name}={getattr(self, f.name)} does nothing with "
                                  f"{prefix}.method={self.method}: set {prefix}.method to "
                                  f"{' | '.join(readers[f.name])}, or leave {prefix}.{f.name} "
                                  f"at its default ({f.default})")

    def drafter_path(self, model_path: str) -> str:
        """Where the draft | eagle | (side-trained) mtp drafter lives ("" for the others)."""
        if self.method not in ("draft", "eagle", "mtp"):
            return ""
        return self.model or f"{model_path.rstrip('/')}/{self.method}"


@dataclass(frozen=True)
class WorkerConfig:
    role: Role = "both"
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC Worker + health service
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)  # used by prefill/decode roles
    # the Worker and bootstrap services, and bootstrap clients
    tls: TLSConfig = field(default_factory=TLSConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    # Identity reported in GetInfo: the launch's cluster id ("" = none) and the replica index.
    cluster_id: str = ""
    replica: int = 0
    # A drain (SIGTERM, or Drain from the gateway) finishes held requests within this, then
    # aborts what is left and exits.
    drain_timeout_s: float = 30.0

    def validate(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ConfigError(f"worker.role must be one of both|prefill|decode, got {self.role!r}")
        if self.drain_timeout_s <= 0:
            raise ConfigError(f"drain_timeout_s must be > 0 seconds, got {self.drain_timeout_s}")
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        self.transfer.validate()
        self.tls.validate()
        self.speculative.validate()

    def replace(self, **changes: object) -> WorkerConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
