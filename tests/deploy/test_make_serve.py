"""`make serve` passes PORT= and ARGS= to `tandem serve` (a second cluster beside one on 8000).

`make -n` prints the recipe without running it; its `tandem serve` line is parsed with the real
command-line parser, so the flags it passes are ones `tandem serve` takes.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from orchestrator.cli import build_parser, serve_config
from orchestrator.config import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def serve_argv(*make_args: str) -> list[str]:
    """The argv after `tandem` of the line `make -n serve ...` would run."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "serve", *make_args],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)
    (line,) = [ln for ln in out.stdout.splitlines() if "/tandem serve" in ln]
    argv = shlex.split(line)
    assert argv[0].endswith("/bin/tandem"), line
    return argv[1:]


def test_plain_make_serve_runs_the_default_config_on_its_port() -> None:
    args = build_parser().parse_args(serve_argv())
    assert (args.command, args.config, args.port) == ("serve", "configs/tiny-1p1d.yaml", None)
    assert serve_config(args).gateway.port == 8000


def test_port_and_args_reach_tandem_serve() -> None:
    argv = serve_argv("PORT=8100", "ARGS=--set transfer.backend=nixl --api-key k")
    args = build_parser().parse_args(argv)
    assert args.port == 8100 and args.api_key == "k"
    assert args.overrides == ["transfer.backend=nixl"]
    cluster = serve_config(args)
    assert (cluster.gateway.port, cluster.transfer.backend) == (8100, "nixl")
    # CONFIG= still picks the file.
    args = build_parser().parse_args(serve_argv("CONFIG=configs/tiny-mono.yaml", "PORT=8101"))
    assert args.config == "configs/tiny-mono.yaml" and args.port == 8101


def test_the_package_metadata_loads_without_a_deprecation_warning() -> None:
    """`make serve` in a fresh clone builds the package (pip install -e): a `project.license`
    TOML table printed setuptools' 12-line deprecation box three times into its output."""
    import warnings

    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), REPO_ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
