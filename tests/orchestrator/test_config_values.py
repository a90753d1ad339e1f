"""Config values that the loader once took and a process could not honour (it crashed at
start, or did something else): each is now refused on load in one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import REPO_ROOT, ClusterConfigError, load_config

TINY = REPO_ROOT / "configs" / "tiny-1p1d.yaml"


def error_of(*overrides: str) -> str:
    with pytest.raises(ClusterConfigError) as info:
        load_config(TINY, list(overrides))
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_gateway_log_level_must_be_one_the_gateway_can_set() -> None:
    # The gateway process died at start: logging.basicConfig(level='LOUD') raised ValueError.
    message = error_of("gateway.log_level=loud")
    assert "gateway.log_level must be one of critical | error | warning | info | debug" in message
    assert "'loud'" in message
    # 'trace' is uvicorn's, not the logging module's: it crashed the same way.
    assert "gateway.log_level" in error_of("gateway.log_level=trace")
    for level in ("DEBUG", "warning", "Info"):
        assert load_config(TINY, [f"gateway.log_level={level}"]).gateway.log_level == level


@pytest.mark.parametrize("field", ["log_tail_lines", "max_restarts", "gpus_per_node"])
def test_launcher_counts_are_not_negative(field: str) -> None:
    # log_tail_lines -5 printed every line but the first five of a failed process's log;
    # gpus_per_node -1 refused a plan with "1 ranks per node but launcher.gpus_per_node=-1".
    message = error_of(f"launcher.{field}=-1")
    assert f"launcher.{field} must be >= 0" in message and "got -1" in message


def test_log_tail_lines_zero_prints_no_line(tmp_path: Path) -> None:
    from orchestrator.launch.processes import tail

    log = tmp_path / "decode-0.log"
    log.write_text("one\ntwo\nthree\n")
    assert tail(log, 2) == "two\nthree"
    assert tail(log, 0) == ""  # [-0:] was the whole log


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_transfer_bootstrap_port_within_range(port: str) -> None:
    # A prefill rank bound its bootstrap service on 70000 as 4464 and on -1 as 65535.
    message = error_of(f"transfer.bootstrap_port={port}")
    assert "transfer.bootstrap_port must be within 0..65535" in message and port in message


@pytest.mark.parametrize("key", ["scheduler.max_waiting", "roles.decode.scheduler.max_waiting"])
def test_max_waiting_zero_is_refused(key: str) -> None:
    # A worker refused every request: 'worker queue is full' with an empty queue.
    message = error_of(f"{key}=0")
    assert f"{key} must be >= 1" in message and "got 0" in message



@pytest.mark.parametrize("key", ["gateway.health_interval_s", "transfer.waiting_timeout_s",
                                 "eval.min_accuracy", "roles.decode.drain_timeout_s"])
def test_a_nan_float_is_refused(key: str) -> None:
    # NaN passed every `<= 0` check (every comparison with NaN is false) and was taken.
    assert error_of(f"{key}=.nan").endswith(f"{key}: expected a number, got nan")


def test_a_nan_float_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nan.yaml"
    path.write_text("roles: {both: {}}\ngateway:\n  request_timeout_s: .NaN\n")
    with pytest.raises(ClusterConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: gateway.request_timeout_s: expected a number, got nan"


def test_eval_task_must_be_a_known_family() -> None:
    # Taken on load; the Slurm gate (eval_on_ready) then failed with UnknownTaskError after the
    # whole cluster had come up, and `tandem eval --config` blamed a --task never typed.
    message = error_of("eval.task=arithmetic")
    assert message == ("--set 'eval.task=arithmetic': eval.task must be one of arith | lookup, "
                       "got 'arithmetic'")


def test_a_role_written_with_nothing_under_it_is_named(tmp_path: Path) -> None:
    # `prefill:` with no keys under it is null: it was "`prefill` is missing. Add roles.prefill".
    path = tmp_path / "pd.yaml"
    path.write_text("roles:\n  prefill:\n  decode:\n    count: 1\n")
    with pytest.raises(ClusterConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: roles.prefill: has no keys (null); write `prefill: {{}}` for the defaults, "
        "or give its keys")


def test_set_null_still_removes_a_role() -> None:
    cluster = load_config(TINY, ["roles.prefill=null", "roles.decode=null", "roles.both.count=1"])
    assert [name for name, _ in cluster.roles.present()] == ["both"]
