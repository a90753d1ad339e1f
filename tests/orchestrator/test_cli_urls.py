"""`tandem eval` / `bench` --url that cannot name a server: one line naming the flag, exit 2,
never a traceback from deep inside httpx or anyio."""

from __future__ import annotations

import pytest

from orchestrator.cli import main

BAD_URLS = ["http://127.0.0.1:99999", "http://host:abc", "http://[::1", "http://", "http://h:0"]


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_url_that_names_no_server_is_one_line(
    command: str, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--url", url, "--num-requests" if command == "bench" else "--samples",
                 "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --url {url!r}") and "http://127.0.0.1:8000" in err


def test_a_client_base_url_is_still_taken(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://[::1]:9/v1", "--samples", "1"]) == 2
    assert "cannot reach http://[::1]:9" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions/", "/v1/models"])
@pytest.mark.parametrize("command", ["eval", "bench"])
def test_an_endpoint_url_is_one_line_naming_the_base(
    command: str, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A URL pasted from a curl line names an endpoint, not the server: said before any
    request (with --model, nothing else would: every request would go to .../completions/v1/...)."""
    url = f"http://127.0.0.1:9{path}"
    assert main([command, "--url", url, "--model", "m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --url {url!r} names an endpoint, not the server; give its base URL, "
                   "http://127.0.0.1:9 (or http://127.0.0.1:9/v1)")
