"""Launchers: bring a whole cluster up from one config (`launcher.kind`).

`local` runs every process on this machine (orchestrator.launch.local); `slurm` runs this
node's part of an allocation (orchestrator.launch.slurm, one task per node); `ray` places
each worker with a placement group on a Ray cluster (orchestrator.launch.ray).
"""

from __future__ import annotations

import sys
from typing import IO

from orchestrator.config import ClusterConfig
from orchestrator.output import reader_may_leave


class LauncherUnavailableError(RuntimeError):
    """The launcher cannot run here (not in an allocation, Ray missing); the message says why."""


def launch(cluster: ClusterConfig, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Run the launcher the config names, in the foreground; returns the exit status."""
    kind = cluster.launcher.kind
    # `tandem serve | head`, or a `tee` Ctrl-C ended first: the launcher still stops in order
    out, err = reader_may_leave(out or sys.stdout), reader_may_leave(err or sys.stderr)
    # Imported per kind: grpc/httpx/ray are only needed once something is launched.
    if kind == "local":
        from orchestrator.launch.local import run_local

        return run_local(cluster, out=out, err=err)
    if kind == "slurm":
        from orchestrator.launch.slurm import run_slurm
        from orchestrator.launch.slurm_env import SlurmEnvError

        try:
            return run_slurm(cluster, out=out, err=err)
        except SlurmEnvError as exc:
            raise LauncherUnavailableError(str(exc)) from None
    if kind == "ray":
        try:
            from orchestrator.launch.ray import run_ray
        except ModuleNotFoundError as exc:
            raise LauncherUnavailableError(
                f"launcher.kind=ray needs the `ray` package ({exc}); "
                "pip install -e '.[ray]' or use launcher.kind=local"
            ) from None
        return run_ray(cluster, out=out, err=err)
    raise LauncherUnavailableError(f"launcher.kind={kind!r} is unknown; use local, slurm or ray")
