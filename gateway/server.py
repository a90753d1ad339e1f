"""Run the gateway: `run_gateway(config)` serves until SIGINT/SIGTERM, then returns."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends `run()` normally.

    uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
    with status 143/130; a gateway asked to stop has done nothing wrong, and launchers read a
    non-zero status as a crash.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_gateway(config: GatewayConfig) -> None:
    """Serve the gateway on config.host:config.port; blocks until SIGINT or SIGTERM."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    # Access logs are off: a log line per request costs about half the throughput.
    http: type | str = "auto"
    if importlib.util.find_spec("httptools") is not None:
        from gateway.http_protocol import NoDelayHttpToolsProtocol

        http = NoDelayHttpToolsProtocol  # small answers leave in one segment, not after an ACK
    server_config = uvicorn.Config(app, host=config.host, port=config.port, loop=loop, access_log=False,
                                   log_level=config.log_level.lower(), timeout_graceful_shutdown=5,
                                   http=http)
    _Server(server_config).run()
