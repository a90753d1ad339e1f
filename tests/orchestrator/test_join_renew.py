"""A worker that joined with `--join` POSTs again every renew_s (orchestrator/launch/join.py):
a gateway that restarted and forgot it lists it again; `leave` stops the renewals before its
DELETE, so a draining worker is never added back."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import pytest

from orchestrator.launch.join import Join
from tests.orchestrator.http_double import HttpDouble, JsonHandler


class _Admin:
    """The gateway's /workers as the worker sees it: listed urls, and every call made."""

    def __init__(self) -> None:
        self.listed: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # (method, url)
        self.up = True
        self.lock = threading.Lock()


class _AdminHandler(JsonHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's names)
        state: _Admin = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/workers":  # as the gateway: its admin routes are at the root
            self._json(404, {"error": {"message": f"Invalid URL (POST {self.path})"}})
            return
        with state.lock:
            state.calls.append(("POST", body["url"]))
            known = body["url"] in state.listed
            state.listed.add(body["url"])
        self._json(200 if known else 201, {"url": body["url"]})

    def do_DELETE(self) -> None:  # noqa: N802
        state: _Admin = self.server.state
        if not self.path.startswith("/workers/"):
            self._json(404, {"error": {"message": f"Invalid URL (DELETE {self.path})"}})
            return
        url = self.path.rsplit("/", 1)[-1]
        with state.lock:
            state.calls.append(("DELETE", url))
            state.listed.discard(url)
        self._json(202, {})


class _AdminDouble(HttpDouble):
    handler = _AdminHandler


def _wait(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _joined(url: str, worker: str, role: str) -> tuple[Join, threading.Thread]:
    """A worker joined at `url` (the admin double), renewing every 50 ms on a thread."""
    join = Join(url, worker, role, "", timeout_s=5.0, renew_s=0.05)
    join.register(time.monotonic() + 5.0)
    renewing = threading.Thread(target=join.renew, daemon=True)
    renewing.start()
    return join, renewing


def test_a_joined_worker_is_listed_again_after_the_gateway_forgets_it() -> None:
    admin = _Admin()
    with _AdminDouble(admin) as url:
        join, renewing = _joined(url, "127.0.0.1:7001", "decode")
        _wait(lambda: sum(m == "POST" for m, _ in admin.calls) >= 3)  # renewals: 200s
        with admin.lock:
            admin.listed.clear()  # the gateway restarted: it lists none of its joined workers
        _wait(lambda: "127.0.0.1:7001" in admin.listed)
        join.leave()
        renewing.join(timeout=5.0)
        assert not renewing.is_alive()
        n = len(admin.calls)
        time.sleep(0.2)  # four renewal periods: none comes after the DELETE
        assert admin.calls[-1] == ("DELETE", "127.0.0.1:7001") and len(admin.calls) == n
        assert "127.0.0.1:7001" not in admin.listed


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_join_takes_the_openai_base_url_of_the_gateway(suffix: str) -> None:
    """`--join http://host:port/v1` (the URL an OpenAI client is given, which `tandem eval`
    and `tandem bench` take) names the same gateway: the join POSTs to its /workers, not
    /v1/workers (a 404 that stopped the worker), and its DELETE lands there too."""
    admin = _Admin()
    with _AdminDouble(admin) as url:
        join, renewing = _joined(url + suffix, "127.0.0.1:7005", "decode")
        join.leave()
        renewing.join(timeout=5.0)
    assert admin.calls[0] == ("POST", "127.0.0.1:7005")
    assert admin.calls[-1] == ("DELETE", "127.0.0.1:7005")


def test_renewals_ride_out_a_gateway_that_does_not_answer() -> None:
    admin = _Admin()
    with _AdminDouble(admin) as url:
        join, renewing = _joined(url, "127.0.0.1:7002", "prefill")
    # The gateway is gone: renewals fail, quietly, and the loop goes on until leave().
    time.sleep(0.3)
    assert renewing.is_alive()
    join.leave()
    renewing.join(timeout=15.0)
    assert not renewing.is_alive()


def test_renewals_log_nothing_at_a_workers_default_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A joined worker renews every 5 s while it serves: at the worker's log level (its
    run_worker logging) that is no line at all while the answer stays the same (httpx logged
    'HTTP Request: POST .../workers "HTTP/1.1 200 OK"' at INFO for each one)."""
    from worker.server import configure_logging

    httpx_logger = logging.getLogger("httpx")
    before = httpx_logger.level
    try:
        configure_logging("decode")
        caplog.set_level(logging.INFO)
        admin = _Admin()
        with _AdminDouble(admin) as url:
            join, renewing = _joined(url, "127.0.0.1:7003", "decode")
            _wait(lambda: sum(m == "POST" for m, _ in admin.calls) >= 4)
            join.leave()
            renewing.join(timeout=5.0)
        assert [r.getMessage() for r in caplog.records if r.name == "httpx"] == []
        assert any(r.name == "tandem.join" for r in caplog.records)  # the join itself: once
    finally:
        httpx_logger.setLevel(before)


def test_a_join_that_gets_no_answer_says_so_once_then_gives_up(caplog) -> None:
    """A gateway that does not answer: one WARNING at the first miss (the worker waited in
    silence for launcher.ready_timeout_s, 300 s), then JoinRefused at the deadline."""
    import socket

    import pytest

    from orchestrator.launch.join import JoinRefused

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level("WARNING", logger="tandem.join")
    join = Join(f"http://127.0.0.1:{port}", "127.0.0.1:7003", "decode", "", 1.0)
    with pytest.raises(JoinRefused, match="did not answer"):
        join.register(time.monotonic() + 1.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.join"]
    assert len(lines) == 1 and "no answer yet" in lines[0], lines


class _MismatchHandler(JsonHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._json(409, {"error": {"message": "refusing the worker: expected cluster ab12, found "
                                   "cluster (none)", "code": "identity_mismatch"}})


class _MismatchDouble(HttpDouble):
    handler = _MismatchHandler


def test_a_join_of_another_cluster_names_the_run_config_to_use() -> None:
    """A newcomer's `--join` with configs/tiny-1p1d.yaml (no cluster id): the refusal says
    which --config joins, not only that the identity differs."""
    from orchestrator.launch.join import JoinRefused

    with _MismatchDouble(None) as url:
        join = Join(url, "127.0.0.1:7004", "decode", "", 5.0)
        with pytest.raises(JoinRefused) as refused:
            join.register(time.monotonic() + 5.0)
    said = str(refused.value)
    assert "HTTP 409" in said and "logs/<gateway port>/cluster.yaml" in said, said


class _HtmlHandler(JsonHandler):
    """Not a gateway: a web server answering HTML (a --join URL with the wrong port)."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        page = b"<!DOCTYPE HTML>\n<html>\n  <body>\n    <h1>Error response</h1>\n  </body>\n"
        self.send_response(501)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)


class _HtmlDouble(HttpDouble):
    handler = _HtmlHandler


def test_a_join_refused_by_something_else_than_a_gateway_is_one_line() -> None:
    """`tandem worker --join` prints the refusal as its one `error:` line: an HTML page (the
    URL of another web server) came through with its newlines."""
    from orchestrator.launch.join import JoinRefused

    with _HtmlDouble(None) as url:
        join = Join(url, "127.0.0.1:7006", "decode", "", 5.0)
        with pytest.raises(JoinRefused) as refused:
            join.register(time.monotonic() + 5.0)
    said = str(refused.value)
    assert "\n" not in said and "HTTP 501" in said, said
    assert "not a Tandem gateway" in said and "text/html" in said, said
