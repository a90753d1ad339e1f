"""`tandem worker` flags out of range get one line naming the flag and the fix, exit 2, no
traceback; none of these tests starts a process."""

from __future__ import annotations

import sys

import pytest

import orchestrator.cli as cli_mod
from orchestrator.cli import main

TINY = "configs/tiny-1p1d.yaml"


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("node_rank", ["3", "-1"])
def test_worker_node_rank_out_of_range_is_one_line(
    node_rank: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["worker", "--config", TINY, "--role", "decode", "--port", "20000",
            "--node-rank", node_rank]
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert f"--node-rank {node_rank}" in err and "roles.decode.parallel.nnodes" in err


@pytest.mark.parametrize("port", ["70000", "-5", "0"])
def test_worker_port_out_of_range_is_refused(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # gRPC took 70000 as 4464 and -5 as 65531: a worker on a port nobody asked for.
    assert main(["worker", "--config", TINY, "--role", "decode", "--port", port]) == 2
    err = _one_line_error(capsys)
    assert f"--port {port}" in err and "1..65535" in err


def test_worker_join_needs_an_http_url(capsys: pytest.CaptureFixture[str]) -> None:
    # It retried POST notaurl/workers until launcher.ready_timeout_s (300 s), then gave up.
    assert main(["worker", "--config", TINY, "--role", "decode", "--join", "notaurl"]) == 2
    err = _one_line_error(capsys)
    assert "--join 'notaurl'" in err and "http://" in err


@pytest.mark.parametrize(("argv", "named"), [
    (["serve", "--port", "70000"], "--port 70000: gateway.port must be within 1..65535"),
    (["plan", "--config", TINY, "--kv-cache-dtype", "fp8_e4m3", "--set",
      "cache.kv_cache_dtype=fp9"], "--set 'cache.kv_cache_dtype=fp9'"),
])
def test_a_named_flags_error_names_the_flag_typed(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said --set 'gateway.port=70000', an override the user never typed; a --set typed
    # is still named as such.
    assert main(argv) == 2
    assert named in _one_line_error(capsys)


@pytest.mark.parametrize(
    ("argv0", "shown"),
    [("/venv/bin/tandem", ["/venv/bin/tandem"]),  # `ps | grep tandem` still finds it
     (cli_mod.__file__, ["-m", "orchestrator.cli"])],  # `python -m orchestrator.cli`
)
def test_the_bind_shim_reexec_keeps_the_command_name(
    argv0: str, shown: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mooncake worker runs itself again with the shim: what `ps` shows stays the command the
    user ran, so a worker started with `tandem worker --join` is found by `grep tandem`."""
    ran: list[list[str]] = []
    monkeypatch.setattr(cli_mod.os, "execve", lambda exe, argv, env: ran.append(argv))
    monkeypatch.setattr(sys, "argv", [argv0, "worker", "--role", "decode"])
    args = cli_mod.build_parser().parse_args(
        ["worker", "--config", TINY, "--role", "decode", "--port", "20000"])
    config = cli_mod._worker_process_config(cli_mod._load(args), args)
    monkeypatch.delenv("TANDEM_BIND_HOST", raising=False)
    cli_mod._reexec_with_bind_shim(config)
    assert ran == [[sys.executable, *shown, "worker", "--role", "decode"]]
