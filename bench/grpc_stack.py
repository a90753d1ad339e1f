"""CPU a received gRPC message costs a grpc.aio client, per gRPC client stack (not a test).

    .venv/bin/python -m bench.grpc_stack [--seconds 5]

One Session stream to bench/mock_worker.py's stepped decode mock (one token a 2 ms step, the
worker's message per engine step), read with `await call.read()` in a loop, in a child process
per stack: gRPC's default EventEngine client, and the iomgr client every tandem process runs
(`GRPC_EXPERIMENTS=-event_engine_client`, protocol/grpc_env.py). Prints process CPU (every
thread) and the event loop thread's CPU per message; protocol/grpc_env.py quotes them.
"""

from __future__ import annotations

import argparse
import json
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # the mock's gRPC port
    args = ap.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(_read(args.child, args.seconds))))
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
