"""Run the gateway: `run_gateway(config)` serves until SIGINT/SIGTERM, then returns.

uvicorn serves the app with the protocol of gateway/connections.py (header deadline, bound on
connections) and `gateway.keepalive_timeout_s` for idle kept-alive connections.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import resource
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.connections import guarded_protocol
from protocol.gc_heap import freeze_startup_heap

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a stop signal ends `run()` normally (and the app's wait
    for its workers at start-up, which uvicorn would sit out), and the startup heap is frozen
    once the app has started (protocol/gc_heap.py).

    uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die
    with status 143/130; a gateway asked to stop has done nothing wrong, and launchers read a
    non-zero status as a crash.
    """

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None] = lambda: None
                 ) -> None:
        super().__init__(config)
        self._on_stop = on_stop  # the app's start-up wait for workers ends on a stop signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._on_stop()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the app's lifespan started: pools, tokenizer, routes
        if not self.should_exit:
            freeze_startup_heap()  # what startup built, no collection traverses again

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_gateway(config: GatewayConfig) -> None:
    """Serve the gateway on config.host:config.port; blocks until SIGINT or SIGTERM."""
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    _raise_fd_limit(config.max_connections + 1024)  # + gRPC channels, files, headroom
    # Access logs are off: a log line per request costs about half the throughput. Nothing
    # reads a request's client address or scheme, so X-Forwarded-* headers are not parsed
    # (uvicorn's proxy-headers middleware wraps every request otherwise).
    server_config = uvicorn.Config(
        app, host=config.host, port=config.port, loop=loop, access_log=False,
        proxy_headers=False,
        log_level=config.log_level.lower(), timeout_graceful_shutdown=5,
        # uvicorn's loggers go through the root handler above: one line format in lb.log
        # (its own config printed `INFO:     Started server process` with no time).
        log_config=None,
        http=guarded_protocol(config.header_timeout_s, config.max_connections,
                              config.max_header_bytes),
        timeout_keep_alive=config.keepalive_timeout_s,  # type: ignore[arg-type]  # float works
    )
    _Server(server_config, on_stop=app.state.gateway.stop_asked).run()


def _raise_fd_limit(want: int) -> None:
    """Lift the soft limit on open files toward `want` (within the hard limit), so the
    connection bound, not EMFILE, is what refuses clients."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < want:
        log.warning("gateway: the open-file limit (%d) is below gateway.max_connections + 1024; "
                    "raise `ulimit -n` or lower max_connections", target)
