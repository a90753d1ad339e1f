"""TLS for the project's gRPC links (gateway → workers, decode → prefill bootstrap, launcher
health checks). Off by default: the local launcher binds 127.0.0.1 only.

With `cert_file` + `key_file`, servers listen with TLS; clients verify the server against
`ca_file` (the CA that signed the servers' certificates, or the self-signed certificate itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """A TLS setting is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str = ""  # PEM certificate this process serves with ("" = TLS off)
    key_file: str = ""  # PEM private key of cert_file
    ca_file: str = ""  # PEM CA bundle clients trust ("" = the system's roots)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def validate(self, prefix: str = "tls") -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise TLSConfigError(f"{prefix}: set both cert_file and key_file, or neither (TLS off)")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise TLSConfigError(f"{prefix}.{name}: {path} is not a readable file")

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())]
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca_file).read_bytes() if self.ca_file else None
        )


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: TLSConfig) -> int:
    """Bind `address` on `server`, with TLS when configured. Returns the port (0 = failed)."""
    if tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def channel(
    address: str, tls: TLSConfig, options: list[tuple[str, int]] | None = None
) -> grpc.Channel:
    """A blocking channel to `address`, secure when TLS is configured."""
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.insecure_channel(address, options=options)


def aio_channel(
    address: str, tls: TLSConfig, options: list[tuple[str, int]] | None = None
) -> grpc.aio.Channel:
    """An asyncio channel to `address`, secure when TLS is configured."""
    if tls.enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)
