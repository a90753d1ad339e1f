"""Configuration of the gateway process (frozen; composed into the cluster config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["round_robin", "least_load", "cache_aware"]


class GatewayConfigError(ValueError):
    """A gateway setting is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_path: str = ""  # tokenizer files (tokenizer.json, tokenizer_config.json) live here
    served_model_name: str = ""  # "" = the workers' served name
    api_key: str = ""  # "" = no auth; else clients send `Authorization: Bearer <key>`
    # Workers as host:port. Mono: `workers` (role both). PD: `prefill` and `decode`.
    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    prefill_policy: Policy = "cache_aware"
    decode_policy: Policy = "least_load"
    health_interval_s: float = 1.0
    health_fail_threshold: int = 2  # consecutive failed checks before a worker is unhealthy
    health_ok_threshold: int = 1  # consecutive good checks before it takes requests again
    request_timeout_s: float = 600.0
    first_token_timeout_s: float = 60.0
    max_request_bytes: int = 4 * 1024 * 1024
    retry_before_first_token: bool = True

    def validate(self, prefix: str = "gateway") -> None:
        if not (self.workers or (self.prefill and self.decode)):
            raise GatewayConfigError(
                f"{prefix}: name worker addresses: `workers` for monolithic serving, or both `prefill` and `decode`"
            )
        if self.workers and (self.prefill or self.decode):
            raise GatewayConfigError(f"{prefix}: set either `workers` (mono) or `prefill`+`decode` (PD), not both")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in ("round_robin", "least_load", "cache_aware"):
                raise GatewayConfigError(
                    f"{prefix}.{name} must be round_robin | least_load | cache_aware, got {getattr(self, name)!r}"
                )
