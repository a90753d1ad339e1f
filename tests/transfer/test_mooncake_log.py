"""Mooncake's start-up noise is gone from worker logs; anything else it prints stays."""

from __future__ import annotations

import os

import pytest

from transfer.mooncake import MooncakeBackend, _quiet_stderr


def test_only_the_named_lines_are_dropped(capfd: pytest.CaptureFixture[str]) -> None:
    with _quiet_stderr(("benign",)):
        os.write(2, b"E1201 x.cpp:1] benign thing\nE1201 y.cpp:2] a real problem\n")
    assert capfd.readouterr().err == "E1201 y.cpp:2] a real problem\n"


def test_a_healthy_start_prints_no_segment_descriptor_error(
        capfd: pytest.CaptureFixture[str]) -> None:
    backend = MooncakeBackend("127.0.0.1")
    try:
        err = capfd.readouterr().err
    finally:
        backend.close()
    assert "Local segment descriptor not found" not in err
    assert "InitGoogleLogging" not in err
