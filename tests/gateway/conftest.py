"""Fixtures for gateway tests: anyio on asyncio, a tokenizer directory, a running app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.gateway.gw_tokenizers import (
    HERMES_TEMPLATE,
    OPEN_THINK_TEMPLATE,
    build_agent_tokenizer,
    build_tokenizer,
)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
async def one_event_loop(anyio_backend: str) -> AsyncIterator[None]:
    """One event loop for every gateway test. grpc.aio's poller hands a finished call back to
    the loop that made it: a call of an earlier test whose loop was already closed raised
    "Event loop is closed" inside a later test (under load: CI and a busy dev box). anyio
    closes its loop when no test or fixture holds it, so a session fixture holds it."""
    yield


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_tokenizer(tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)


@pytest.fixture(scope="session")
def open_think_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_tokenizer(tmp_path_factory.mktemp("openthink"), OPEN_THINK_TEMPLATE)
