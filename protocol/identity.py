"""Worker identity: who a worker is, and the one-line refusal when it is not who was expected.

A launch draws a cluster id; every worker it starts reports that id, its role, its replica and
its model fingerprint in `GetInfo`. The launcher's readiness check and the gateway compare that
with what they expect, at start and at every reconnect, so a worker of another cluster (or of
another model) that answers on an expected address is refused, never served through.

Shared by the orchestrator (readiness), the gateway (pool membership) and the worker (what it
reports), so it lives here and imports nothing of ours.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from protocol import tandem_pb2

_CONFIG_HASH_HEX = 16  # enough to tell checkpoints apart, short enough to read in one line


def model_fingerprint(
    served_name: str, model_path: str, load_format: str = "auto", seed: int = 0
) -> str:
    """`<served name>:<sha256 of config.json, 16 hex>`, plus `:dummy<seed>` for dummy weights.

    Computable without torch and without the weights (the gateway may run on a node that has
    only the tokenizer and config files); "nocfg" where config.json cannot be read, so the
    mismatch still shows in the refusal line instead of an exception.
    """
    try:
        digest = hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        digest = "nocfg"
    fp = f"{served_name}:{digest[:_CONFIG_HASH_HEX]}"
    return f"{fp}:dummy{seed}" if load_format == "dummy" else fp


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker must report to be accepted. An empty field is not checked (a gateway
    started by hand without a cluster id accepts any cluster; `replica < 0` any replica)."""

    cluster_id: str = ""
    role: str = ""  # prefill | decode | both
    replica: int = -1
    model_fingerprint: str = ""

    def describe(self) -> str:
        """`cluster c1 role decode replica 0 model m:ab12` (only the checked fields)."""
        parts = []
        if self.cluster_id:
            parts.append(f"cluster {self.cluster_id}")
        if self.role:
            parts.append(f"role {self.role}")
        if self.replica >= 0:
            parts.append(f"replica {self.replica}")
        if self.model_fingerprint:
            parts.append(f"model {self.model_fingerprint}")
        return " ".join(parts) or "any worker"

    def found_in(self, info: tandem_pb2.WorkerInfo) -> WorkerIdentity:
        """The same fields as `info` reports them (so both sides of the message line up)."""
        return WorkerIdentity(
            cluster_id=(info.cluster_id or "(none)") if self.cluster_id else "",
            role=(info.role or "(none)") if self.role else "",
            replica=info.replica if self.replica >= 0 else -1,
            model_fingerprint=(
                (info.model_fingerprint or "(none)") if self.model_fingerprint else ""
            ),
        )

    def mismatch(self, address: str, info: tandem_pb2.WorkerInfo) -> str:
        """'' when `info` matches; else one line naming the address, what was expected and
        what answered."""
        found = self.found_in(info)
        if found == self:
            return ""
        return (
            f"refusing the worker at {address}: expected {self.describe()}, "
            f"found {found.describe()} (a worker of another cluster or model answers there)"
        )
