"""gRPC core's settings for every Tandem process, read once, when grpc is first imported.

A grpc.aio client on gRPC's default I/O stack (its EventEngine) hands each message it receives
across three threads: an EventEngine poller reads the socket, completes the call on the
completion queue, whose poller thread wakes the asyncio loop. On the 2-core dev box that cost
~120 µs of CPU per message received on a Session stream (`python -m bench.grpc_stack`; the
gateway pays it once per engine step of each worker), against 64-72 µs with the client on
the older iomgr stack, where the completion queue's poller reads the socket itself.
The gateway is such a client for every step of every worker, so every Tandem process starts
with the EventEngine client turned off (`GRPC_EXPERIMENTS=-event_engine_client`; servers keep
their EventEngine listener). A value already in the environment wins: `GRPC_EXPERIMENTS=`
(empty) runs gRPC's own defaults.

The setting must be in the environment before the process first imports grpc:
`orchestrator/__init__.py` applies it before any `tandem` command's imports, and the benches
pass `GRPC_ENV` to the processes they start. Nothing here imports grpc.
"""

from __future__ import annotations

from collections.abc import MutableMapping

GRPC_ENV = {"GRPC_EXPERIMENTS": "-event_engine_client"}


def apply_grpc_env(environ: MutableMapping[str, str]) -> None:
    """Put `GRPC_ENV` into `environ` where it has no value of its own."""
    for key, value in GRPC_ENV.items():
        environ.setdefault(key, value)
