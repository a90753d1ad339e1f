"""Config values that the loader once took and a process could not honour (it crashed at
start, or did something else): each is now refused on load in one line naming the field."""

from __future__ import annotations

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
