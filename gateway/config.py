"""Configuration of the gateway process (frozen; composed into the cluster config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.parsers import AUTO, NONE, REASONING_PARSERS, TOOL_CALL_PARSERS
from protocol.tls import TLSConfig

Policy = Literal["round_robin", "least_load", "cache_aware"]
# Levels both the logging module and uvicorn know (uvicorn's `trace` is not logging's).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class GatewayConfigError(ValueError):
    """A gateway setting is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_path: str = ""  # tokenizer files (tokenizer.json, tokenizer_config.json) live here
    served_model_name: str = ""  # "" = the workers' served name
    api_key: str = ""  # "" = no auth; else clients send `Authorization: Bearer <key>`
    # /workers (GET, POST, DELETE) and /metrics take this key instead; "" = the admin routes
    # that change the pools are off (403), and with an api_key set /workers and /metrics too.
    admin_key: str = ""
    metrics_public: bool = False  # /metrics answers anyone (a Prometheus scraper without a key)
    # Identity every worker must report in GetInfo ("" = not checked: a gateway run by hand).
    cluster_id: str = ""
    model_fingerprint: str = ""  # protocol.identity.model_fingerprint of the served model
    # DELETE /workers/{id}: how long the drained worker may take before it is dropped anyway.
    drain_timeout_s: float = 30.0
    # Workers as host:port. Mono: `workers` (role both). PD: `prefill` and `decode`.
    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_policy: Policy = "cache_aware"
    decode_policy: Policy = "least_load"
    health_interval_s: float = 1.0
    health_fail_threshold: int = 2  # consecutive failed checks before a worker is unhealthy
    health_ok_threshold: int = 1  # consecutive good checks before it takes requests again
    # A busy worker may answer a check slowly; only a dead or hung one should fail it. (A dead
    # worker's connection is refused at once, so this does not slow down detecting it.)
    health_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 60.0
    max_request_bytes: int = 4 * 1024 * 1024
    # A request body must arrive within this (a slow-loris client gets 408, not a held slot).
    body_timeout_s: float = 30.0
    # Bytes of request bodies being read at once, over all connections: past it a body gets 503
    # + Retry-After (else the bound was max_connections x max_request_bytes, 16 GiB by default,
    # for clients that send most of a body and stall). 64 full-size bodies in flight.
    max_body_buffer_bytes: int = 256 * 1024 * 1024
    retry_before_first_token: bool = True
    # Partial failure (docs/reliability.md). After the first token, a stream with no token for
    # this long ends with an error event and an Abort to both legs, and the worker is marked
    # suspect: a few seconds above the worst step time (a recompute after preemption).
    stream_stall_timeout_s: float = 10.0
    # Backpressure: requests wait at the gateway (in arrival order) while every decode worker
    # is full; at most this many (then 429 + Retry-After), at most this long (then 503).
    max_queued_requests: int = 1024
    queue_timeout_s: float = 300.0
    # Connection hygiene (gateway/connections.py): a request's headers must arrive within
    # header_timeout_s of the connection (or of its first byte, on a kept-alive one), else 408
    # and close; an idle kept-alive connection closes after keepalive_timeout_s; past
    # max_connections open at once, a new connection gets 503 and is closed.
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 5.0
    max_connections: int = 4096
    # A request's headers past this many bytes get 431 and a close (httptools buffers them
    # without limit). nginx allows 4 x 8 KiB, Node 16 KiB; 64 KiB leaves room for long tokens.
    max_header_bytes: int = 64 * 1024
    tls: TLSConfig = field(default_factory=TLSConfig)  # verify workers over TLS (ca_file)
    # GetLoad refresh period: feeds least_load / cache_aware and GET /workers.
    load_interval_s: float = 0.5
    # Start-up waits (a readiness signal with a deadline) until every pool has a healthy
    # worker; past the deadline the gateway serves anyway and /health says 503.
    startup_wait_s: float = 30.0
    # cache_aware: take the best-prefix worker unless its load exceeds the least-loaded
    # worker's by more than this (load = running + waiting + in-flight + KV fraction).
    cache_aware_load_threshold: float = 8.0
    # cache_aware: page hashes remembered (LRU); bounds the gateway's memory.
    cache_aware_max_pages: int = 200_000
    log_level: str = "info"
    # Output parsers of the chat API (names as vLLM's / SGLang's flags). "auto" reads the chat
    # template (gateway/parsers/__init__.py says how); "none" turns the parser off.
    reasoning_parser: str = AUTO  # auto | none | qwen3 | deepseek_r1
    tool_call_parser: str = AUTO  # auto | none | hermes | qwen3 | qwen3_coder | llama3_json | ...
    # auto: a request's unset sampling fields take generation_config.json's values (vLLM's
    # default); none: the API's defaults (gateway/sampling_defaults.py)
    generation_config: str = AUTO

    def validate(self, prefix: str = "gateway") -> None:
        if not (self.workers or (self.prefill and self.decode)):
            raise GatewayConfigError(
                f"{prefix}: name worker addresses: `workers` for monolithic serving, "
                "or both `prefill` and `decode`"
            )
        if self.workers and (self.prefill or self.decode):
            raise GatewayConfigError(
                f"{prefix}: set either `workers` (mono) or `prefill`+`decode` (PD), not both"
            )
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in ("round_robin", "least_load", "cache_aware"):
                raise GatewayConfigError(
                    f"{prefix}.{name} must be round_robin | least_load | cache_aware, "
                    f"got {getattr(self, name)!r}"
                )
        for name in (
            "health_interval_s",
            "load_interval_s",
            "request_timeout_s",
            "first_token_timeout_s",
            "body_timeout_s",
            "stream_stall_timeout_s",
            "queue_timeout_s",
            "header_timeout_s",
            "keepalive_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise GatewayConfigError(
                    f"{prefix}.{name} must be > 0 seconds, got {getattr(self, name)}"
                )
        for name in (
            "health_fail_threshold",
            "health_ok_threshold",
            "max_request_bytes",
            "cache_aware_max_pages",
            "max_queued_requests",
            "max_connections",
            "max_header_bytes",
        ):
            if getattr(self, name) < 1:
                raise GatewayConfigError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)}")
        for name, known in (("reasoning_parser", REASONING_PARSERS),
                            ("tool_call_parser", TOOL_CALL_PARSERS)):
            value = getattr(self, name)
            if value not in (AUTO, NONE, *known):
                raise GatewayConfigError(f"{prefix}.{name} must be one of auto | none | "
                                         f"{' | '.join(known)}, got {value!r}")
        if self.log_level.lower() not in LOG_LEVELS:  # logging.basicConfig raises at start
            raise GatewayConfigError(f"{prefix}.log_level must be one of "
                                     f"{' | '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.generation_config not in (AUTO, NONE):
            raise GatewayConfigError(f"{prefix}.generation_config must be auto | none, got "
                                     f"{self.generation_config!r}")
        if self.max_body_buffer_bytes < self.max_request_bytes:
            raise GatewayConfigError(
                f"{prefix}.max_body_buffer_bytes ({self.max_body_buffer_bytes}) must be >= "
                f"{prefix}.max_request_bytes ({self.max_request_bytes}): else no full-size body "
                "could ever be read"
            )
        if self.admin_key and self.admin_key == self.api_key:
            raise GatewayConfigError(
                f"{prefix}.admin_key must differ from {prefix}.api_key: "
                "a client key must not administer the pools"
            )
        if self.drain_timeout_s <= 0:
            raise GatewayConfigError(
                f"{prefix}.drain_timeout_s must be > 0 seconds, got {self.drain_timeout_s}"
            )
        if self.startup_wait_s < 0:
            raise GatewayConfigError(
                f"{prefix}.startup_wait_s must be >= 0 (0 = do not wait), got {self.startup_wait_s}"
            )

    @property
    def pd(self) -> bool:
        """True when prefill and decode are separate pools."""
        return not self.workers
