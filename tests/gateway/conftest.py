"""Fixtures for gateway tests: anyio on asyncio, a tokenizer directory, a running app."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gateway.gw_doubles import build_tokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))
