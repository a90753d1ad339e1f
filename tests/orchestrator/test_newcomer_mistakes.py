"""Mistakes a newcomer makes with the CLI, found by following README.md and docs/ literally:
each one is a line naming what to fix, never a traceback, and never harm to anything else.

- a mistyped command or a bad flag value: argparse's usage block, then its error, then (for a
  command) no suggestion; now one line with the command, and the closest command;
- `--set launcher.run_dir=DIR` on a directory of one's own: it was renamed to `DIR.prev`, and
  an existing `DIR.prev` deleted (rmtree); on a running cluster's run directory: that cluster's
  logs and cluster.yaml were moved away under it;
- `tandem serve | head` (or a `tee` ended by Ctrl-C): a BrokenPipeError traceback;
- an unwritable TANDEM_CACHE_DIR (a read-only home): every Mooncake worker died in a traceback;
- `tandem gateway` on a taken port: uvicorn's lines and exit 3, after dialing every worker;
- `--model models/tandem-arth` (a typo): "fetch it with `huggingface-cli download
  models/tandem-arth`"; `tandem plan` of an uncached ORG/NAME: "ORG/NAME/config.json not found".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.checkpoint import CheckpointError, model_dir
from orchestrator.cli import build_parser, main
from orchestrator.config import REPO_ROOT, ClusterConfigError, load_config
from orchestrator.launch.run_dir import RunDir
from orchestrator.output import reader_may_leave
from orchestrator.plan_text import format_plan


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(("argv", "expected"), [
    ([], "error: tandem: give a command: serve, worker, gateway, launch, plan, eval, bench; "
         "see tandem --help"),
    (["serv"], "error: tandem: unknown command 'serv' (commands: serve, worker, gateway, launch, "
               "plan, eval, bench); did you mean serve?"),
    (["plan", "--dtype", "fp16"], "error: tandem plan: argument --dtype: invalid choice: 'fp16' "
                                  "(choose from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["serve", "--port", "abc"], "error: tandem serve: argument --port: invalid int value: "
                                 "'abc'; see tandem serve --help"),
    (["worker", "--config", "x.yaml"], "error: tandem worker: the following arguments are "
                                       "required: --role; see tandem worker --help"),
    (["plan", "--config"], "error: tandem plan: argument --config: expected one argument; "
                           "see tandem plan --help"),
])
def test_command_line_mistakes_are_one_line(argv: list[str], expected: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert _err_line(capsys) == expected


def test_help_still_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: tandem plan")


# --- run directories -------------------------------------------------------------------------


def test_a_directory_that_is_not_a_run_is_never_moved_or_deleted(tmp_path: Path) -> None:
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(ClusterConfigError, match=r"launcher.run_dir: .*mydata is not a Tandem "
                       r"run directory \(it holds notes.txt; a run's holds only cluster.yaml and "
                       r"logs\)"):
        RunDir(mine)
    assert (mine / "notes.txt").read_text() == "precious"
    assert not (tmp_path / "mydata.prev").exists()

    # a run directory whose `.prev` is somebody's own directory: refused, nothing deleted
    run = tmp_path / "r"
    run.mkdir()
    (tmp_path / "r.prev").mkdir()
    (tmp_path / "r.prev" / "keep.txt").write_text("older")
    with pytest.raises(ClusterConfigError, match=r"r.prev is not a Tandem run directory"):
        RunDir(run)
    assert (tmp_path / "r.prev" / "keep.txt").read_text() == "older" and run.is_dir()

    # one's own directory that happens to hold a cluster.yaml is not a run's either
    (mine / "cluster.yaml").write_text("model: {}\n")
    with pytest.raises(ClusterConfigError, match=r"mydata is not a Tandem run directory"):
        RunDir(mine)
    assert (mine / "notes.txt").read_text() == "precious"

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ClusterConfigError, match=r"afile is not a directory"):
        RunDir(afile)
    assert afile.read_text() == "x"


def test_a_previous_run_still_moves_to_prev(tmp_path: Path) -> None:
    run = tmp_path / "8000"
    with RunDir(run):
        (run / "cluster.yaml").write_text("a: 1\n")
        (run / "lb.log").write_text("first\n")
    with RunDir(run):  # the earlier run there is over: moved aside
        assert list(run.iterdir()) == []
        assert (tmp_path / "8000.prev" / "lb.log").read_text() == "first\n"
        (run / "lb.log").write_text("second\n")  # a run that died before its cluster.yaml
    with RunDir(run):
        assert (tmp_path / "8000.prev" / "lb.log").read_text() == "second\n"


def test_a_running_clusters_run_directory_is_left_alone(tmp_path: Path) -> None:
    """Another process's launch holds its run directory: a second launch pointed there (its
    launcher.run_dir, or log_dir + the same port on another host) is refused, in one line."""
    run = tmp_path / "42100"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from orchestrator.launch.run_dir import RunDir
            run = RunDir(Path({str(run)!r})).path
            (run / "cluster.yaml").write_text("live: true\\n")
            print("held", flush=True)
            sys.stdin.read()
        """)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ClusterConfigError, match=r"is the run directory of a cluster that is "
                                                     r"still running"):
            RunDir(run)
        assert (run / "cluster.yaml").read_text() == "live: true\n"
        assert not (tmp_path / "42100.prev").exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    with RunDir(run):  # once that cluster has stopped, its directory is a previous run
        assert (tmp_path / "42100.prev" / "cluster.yaml").read_text() == "live: true\n"


# --- a reader that leaves ----------------------------------------------------------------------


def test_printing_to_a_pipe_whose_reader_left_is_dropped() -> None:
    r, w = os.pipe()
    os.close(r)
    with os.fdopen(w, "w") as raw:
        out = reader_may_leave(raw)
        print("ready: ...", file=out, flush=True)  # raised BrokenPipeError before
        print("stopped: ...", file=out, flush=True)
        raw.flush()  # the descriptor now points at /dev/null: nothing left to fail at exit


def test_tandem_plan_into_a_closed_pipe_ends_without_a_traceback() -> None:
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan"], cwd=REPO_ROOT,
                          stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    os.close(w)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# --- the bind shim's cache directory -----------------------------------------------------------


def test_an_unwritable_cache_dir_is_a_warning_not_a_dead_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from orchestrator.cli import _reexec_with_bind_shim, _worker_process_config

    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocker / "cache"))  # under a file: no mkdir
    monkeypatch.setenv("CC", "cc")
    monkeypatch.delenv("TANDEM_BIND_HOST", raising=False)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed without the shim"))
    cluster = load_config(REPO_ROOT / "configs/tiny-1p1d.yaml")
    args = build_parser().parse_args(["worker", "--config", "x", "--role", "decode",
                                      "--port", "40001"])
    _reexec_with_bind_shim(_worker_process_config(cluster, args))
    err = capsys.readouterr().err
    assert err.startswith("warning: mooncake's listeners will bind every interface: cannot build "
                          f"the bind shim in {blocker / 'cache'} (") and "TANDEM_CACHE_DIR" in err


# --- a gateway on a taken port -----------------------------------------------------------------


def test_gateway_on_a_taken_port_is_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["gateway", "--config", "configs/tiny-1p1d.yaml",
                   "--set", "roles.prefill.base_port=40100", "--set",
                   "roles.decode.base_port=40200", "--set", f"gateway.port={port}"])
    assert rc == 2
    assert _err_line(capsys) == (f"error: port {port} (gateway, gateway.port) is in use on "
                                 "127.0.0.1: another gateway or cluster? stop it, or --set "
                                 "gateway.port=N")


# --- a model that is not there -----------------------------------------------------------------


def test_a_mistyped_local_model_path_names_the_closest_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(CheckpointError) as exc:
        model_dir("models/tandem-arth")
    text = str(exc.value)
    assert "did you mean models/tandem-arith?" in text and "huggingface-cli" not in text


def test_plan_of_an_uncached_hub_name_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    cluster = load_config(REPO_ROOT / "configs/tiny-1p1d.yaml", ["model.path=Qwen/Qwen3-8B"])
    last = format_plan(cluster).splitlines()[-1]
    assert last.startswith("KV budget: unknown (model.path: model 'Qwen/Qwen3-8B': no such "
                           "directory, and not in the Hugging Face cache (looked for "
                           f"{tmp_path / 'models--Qwen--Qwen3-8B'}")
    assert "huggingface-cli download Qwen/Qwen3-8B" in last


# --- the docs name every flag ------------------------------------------------------------------


def test_docs_config_commands_name_every_flag() -> None:
    """docs/config.md's Commands list every flag of every subcommand (serve's
    --generation-config and --enforce-eager, eval's --config, bench's --clients were missing)."""
    text = (REPO_ROOT / "docs" / "config.md").read_text()
    section = text[text.index("## Commands"):]
    bullets = ["- " + b for b in section.split("\n- ")[1:]]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, cmd in sub.choices.items():
        about = " ".join(b for b in bullets if f"`tandem {name} " in b)
        assert about, f"docs/config.md has no `tandem {name}` under Commands"
        missing += [f"tandem {name} {flag}" for action in cmd._actions
                    for flag in action.option_strings
                    if flag.startswith("--") and flag != "--help" and flag not in about]
    assert not missing, f"docs/config.md, Commands: not documented: {missing}"


def test_a_missing_revision_is_fetched_by_its_revision(tmp_path: Path) -> None:
    from orchestrator.hub import HubModelError, resolve_repo_id

    env = {"HF_HUB_CACHE": str(tmp_path)}
    with pytest.raises(HubModelError, match=r"`huggingface-cli download org/name --revision v2`"):
        resolve_repo_id("org/name@v2", env)
    (tmp_path / "models--org--name" / "snapshots").mkdir(parents=True)
    with pytest.raises(HubModelError, match=r"`huggingface-cli download org/name --revision v2`"):
        resolve_repo_id("org/name@v2", env)
    with pytest.raises(HubModelError, match=r"`huggingface-cli download org/name` \(or pass"):
        resolve_repo_id("org/name", env)


def test_a_bad_host_in_hosts_names_hosts(tmp_path: Path) -> None:
    from orchestrator.launch.ports import resolve_ports

    cluster = load_config(REPO_ROOT / "configs/tiny-1p1d.yaml",
                          ["roles.decode.hosts=[nosuch.invalid]"])
    with pytest.raises(ClusterConfigError, match=r"^roles.decode.hosts: host 'nosuch.invalid' "
                                                 r"does not resolve"):
        resolve_ports(cluster)
