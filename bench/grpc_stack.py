"""CPU a received gRPC message costs a grpc.aio client, per gRPC client stack (not a test).

    .venv/bin/python -m bench.grpc_stack [--seconds 5]
    .venv/bin/python -m bench.grpc_stack --round-trips 2000

One Session stream to bench/mock_worker.py's stepped decode mock (one token a 2 ms step, the
worker's message per engine step), read with `await call.read()` in a loop, in a child process
per stack: gRPC's default EventEngine client, and the iomgr client every tandem process runs
(`GRPC_EXPERIMENTS=-event_engine_client`, protocol/grpc_env.py). Prints process CPU (every
thread) and the event loop thread's CPU per message; protocol/grpc_env.py quotes them.

`--round-trips N`: the median round trip of one request at a time instead, on the plain mock
(one token a request): a Submit on an open Session stream to its one-message answer, per
stack, beside an HTTP POST to the same mock process on a kept-alive connection (the routers'
path). The difference is what gRPC's two ends add to every worker leg at low load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway import free_port, process, wait_mock  # noqa: E402

STACKS = {"EventEngine (gRPC's default)": "", "iomgr (tandem's)": "-event_engine_client"}


async def _read(port: int, seconds: float) -> dict[str, float]:
    import grpc

    from protocol import tandem_pb2, tandem_pb2_grpc

    submit = tandem_pb2.SessionRequest(submits=[tandem_pb2.Submit(slot=1, request=(
        tandem_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                   sampling=tandem_pb2.SamplingParams(max_tokens=1 << 20))))])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = tandem_pb2_grpc.WorkerStub(ch).Session()
        await call.write(submit)
        await call.read()
        n, t0 = 0, time.perf_counter()
        cpu0, loop0 = time.process_time(), time.thread_time()
        while time.perf_counter() - t0 < seconds:
            await call.read()
            n += 1
        out = {"messages": n, "cpu_us": (time.process_time() - cpu0) / n * 1e6,
               "loop_us": (time.thread_time() - loop0) / n * 1e6}
        call.cancel()
    return out


async def _round_trips(port: int, n: int) -> float:
    """Median seconds from a Submit's write to its answer, one request at a time."""
    import grpc

    from protocol import tandem_pb2, tandem_pb2_grpc

    times = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = tandem_pb2_grpc.WorkerStub(ch).Session()
        for i in range(n):
            frame = tandem_pb2.SessionRequest(submits=[tandem_pb2.Submit(slot=i + 1, request=(
                tandem_pb2.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, 3],
                                           sampling=tandem_pb2.SamplingParams(max_tokens=1))))])
            t = time.perf_counter()
            await call.write(frame)
            await call.read()
            times.append(time.perf_counter() - t)
        call.cancel()
    return statistics.median(times[n // 10:])


async def _http_round_trips(port: int, n: int) -> float:
    """The same for an HTTP/1.1 POST on one kept-alive connection to the mock's HTTP side."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    post = b"POST /v1/completions HTTP/1.1\r\nHost: mock\r\nContent-Length: 2\r\n\r\n{}"
    times = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(post)
        await reader.readuntil(b"}}")  # the end of the mock's JSON body
        times.append(time.perf_counter() - t)
    writer.close()
    return statistics.median(times[n // 10:])


def round_trips(n: int) -> None:
    gp, hp = free_port(), free_port()
    with process([sys.executable, "-m", "bench.mock_worker", "--role", "decode", "--grpc-port",
                  str(gp), "--http-port", str(hp)], Path(tempfile.mkdtemp()) / "mock.log"):
        wait_mock(hp)
        runs = [(f"Session stream, {name}", experiments, ["--child-rtt", str(gp)])
                for name, experiments in STACKS.items()]
        runs.append(("HTTP/1.1 POST, kept alive", "", ["--child-http", str(hp)]))
        for name, experiments, child in runs:
            env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
            out = subprocess.run([sys.executable, "-m", "bench.grpc_stack", *child,
                                  "--round-trips", str(n)], cwd=ROOT, env=env, check=True,
                                 capture_output=True, text=True).stdout
            print(f"{name}: {float(out.strip().splitlines()[-1]) * 1e6:.0f} us a round trip "
                  f"(median of {n - n // 10})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--round-trips", type=int, metavar="N",
                    help="time N round trips one at a time instead (gRPC and HTTP)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # the mock's gRPC port
    ap.add_argument("--child-rtt", type=int, help=argparse.SUPPRESS)  # the mock's gRPC port
    ap.add_argument("--child-http", type=int, help=argparse.SUPPRESS)  # the mock's HTTP port
    args = ap.parse_args()
    if args.child or args.child_rtt or args.child_http:
        import uvloop

        if args.child:
            print(json.dumps(uvloop.run(_read(args.child, args.seconds))))
        elif args.child_rtt:
            print(uvloop.run(_round_trips(args.child_rtt, args.round_trips)))
        else:
            print(uvloop.run(_http_round_trips(args.child_http, args.round_trips)))
        return
    if args.round_trips:
        round_trips(args.round_trips)
        return
    gp, hp = free_port(), free_port()
    with process([sys.executable, "-m", "bench.mock_worker", "--role", "decode", "--grpc-port",
                  str(gp), "--http-port", str(hp), "--tokens", str(1 << 20), "--step-ms", "2"],
                 Path(tempfile.mkdtemp()) / "mock.log"):
        wait_mock(hp)
        for name, experiments in STACKS.items():
            env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
            out = subprocess.run([sys.executable, "-m", "bench.grpc_stack", "--child", str(gp),
                                  "--seconds", str(args.seconds)], cwd=ROOT, env=env,
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{name}: {r['cpu_us']:.1f} us of process CPU a message, "
                  f"{r['loop_us']:.1f} us of it the event loop's ({r['messages']} messages)")


if __name__ == "__main__":
    main()
