"""A launch's run directory (its logs and cluster.yaml), made fresh and held while it runs.

A new run moves the previous run's directory to `<dir>.prev` (replacing an older one), but only
a directory that is a stopped run's: what a launcher writes there and nothing else (cluster.yaml,
`*.log` files), not a symbolic link, and not held by a running launch. A launch holds its
directory with an exclusive flock on the directory itself (no file of its own in it) until it
ends, so another launch pointed at the same directory (a `launcher.run_dir`, or `log_dir` + a
port another host already serves on) is refused in one line instead of moving a live cluster's
logs and cluster.yaml away. A filesystem without flock (some network ones) is not checked.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from types import TracebackType

from orchestrator.config import ClusterConfigError

_FIX = ("point launcher.run_dir at a new directory, or leave it \"\" for "
        "<launcher.log_dir>/<gateway port>")


class RunDir:
    """An empty run directory at `path`, held by this launch until `close()` (or the `with`
    block's end). ClusterConfigError naming the keys when it cannot be made: a file in the way,
    no permission, a directory that is not a run's, a cluster still running there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            if path.exists() or path.is_symlink():
                _move_aside(path)
            path.mkdir(parents=True)
            self._fd = _lock(path)
        except OSError as exc:
            raise ClusterConfigError(
                f"launcher.run_dir: cannot create {path} ({exc.strerror or exc}); set "
                "launcher.log_dir (or launcher.run_dir) to a directory you can write") from None

    def close(self) -> None:
        """Let another launch take the directory (this one's cluster has stopped)."""
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _lock(path: Path) -> int | None:
    """A descriptor of directory `path` holding an exclusive flock on it; None when another
    launch holds it. A filesystem without flock gives no lock (-1)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:  # no flock here: unchecked, as before
        os.close(fd)
        return -1
    return fd


def _not_a_run(path: Path) -> str:
    """Why `path` may not be moved aside (or deleted) as a previous run's directory; "" = it
    may."""
    if path.is_symlink():
        return "is a symbolic link"
    if not path.is_dir():
        return "is not a directory"
    names = sorted(e.name for e in path.iterdir())
    others = [n for n in names
              if not ((n == "cluster.yaml" or n.endswith(".log")) and (path / n).is_file())]
    if not others:
        return ""
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return (f"is not a Tandem run directory (it holds {shown}; a run's holds only cluster.yaml "
            "and logs)")


def _move_aside(path: Path) -> None:
    """The previous run's directory to `<path>.prev`, replacing an older one."""
    _check_previous(path, f"a new run moves the previous run's directory to .prev: {_FIX}")
    absolute = path.resolve()
    prev = absolute.with_name(absolute.name + ".prev")
    if prev.exists() or prev.is_symlink():
        _check_previous(prev, "the previous run's directory moves there, replacing it: move it "
                              f"away, or {_FIX}")
    shutil.rmtree(prev, ignore_errors=True)
    path.rename(prev)


def _check_previous(path: Path, why: str) -> None:
    """ClusterConfigError unless `path` is a stopped run's directory, free to move or delete."""
    if problem := _not_a_run(path):
        raise ClusterConfigError(f"launcher.run_dir: {path} {problem}; {why}")
    fd = _lock(path)
    if fd is None:
        raise ClusterConfigError(
            f"launcher.run_dir: {path} is the run directory of a cluster that is still "
            "running; give this cluster its own (another --port, or launcher.run_dir)")
    if fd >= 0:
        os.close(fd)
