"""Launchers: bring a whole cluster up from one config (`launcher.kind`).

`local` runs every process on this machine (orchestrator.launch.local). `slurm` and `ray`
are named in the config tree already; they are not implemented yet and say so.
"""

from __future__ import annotations

from typing import IO

from orchestrator.config import ClusterConfig


class LauncherUnavailableError(RuntimeError):
    """The config names a launcher kind that this build cannot run yet."""


def launch(cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the launcher the config names, in the foreground; returns the exit status."""
    kind = cluster.launcher.kind
    if kind == "local":
        # Imported here: grpc/httpx are only needed once something is launched.
        from orchestrator.launch.local import run_local

        return run_local(cluster, out=out, err=err)
    raise LauncherUnavailableError(
        f"launcher.kind={kind!r} is not available yet; use launcher.kind=local "
        f"(e.g. --set launcher.kind=local) to run every process on this machine"
    )
