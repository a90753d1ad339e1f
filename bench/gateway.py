"""Gateway overhead bench (not a test): added latency at concurrency 1, req/s at concurrency N.

Three processes: a scripted worker (one token per request), the gateway (run_gateway, uvloop),
and this load generator (aiohttp, keep-alive). Added latency = median HTTP round trip through
the gateway minus the median direct gRPC Generate round trip to the same worker.

    .venv/bin/python -m bench.gateway --requests 3000 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol import tandem_pb2, tandem_pb2_grpc  # noqa: E402
from tests.gateway.gw_doubles import Script, ScriptedWorker, build_tokenizer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve_worker(port: int) -> None:
    w = ScriptedWorker(max_model_len=4096, script=Script(tokens=[70], finish_reason="stop"))
    await w.start(port=port)
    await asyncio.Event().wait()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct_latency(port: int, n: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = tandem_pb2_grpc.WorkerStub(ch)
        req = tandem_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3],
                                         sampling=tandem_pb2.SamplingParams(max_tokens=1))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            async for _ in stub.Generate(req):
                pass
            times.append(time.perf_counter() - t)
    return statistics.median(times[n // 10:])


async def http_run(url: str, n: int, concurrency: int, stream: bool) -> tuple[float, float]:
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 1, "stream": stream})
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def one() -> None:
            t = time.perf_counter()
            async with s.post(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, await r.text()
            lat.append(time.perf_counter() - t)

        async def client(k: int) -> None:
            for _ in range(k):
                await one()

        for _ in range(50):  # warm-up
            await one()
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(client(n // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return statistics.median(lat), len(lat) / wall


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--role", default="bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--worker-port", type=int, default=0)
    ap.add_argument("--tok-dir", default="")
    ap.add_argument("--profile", default="", help="write a cProfile of the gateway process here")
    args = ap.parse_args()
    if args.role == "worker":
        await serve_worker(args.port)
        return
    wport, gport = free_port(), free_port()
    tok_dir = build_tokenizer(Path(tempfile.mkdtemp()))
    worker = subprocess.Popen([sys.executable, __file__, "--role", "worker", "--port", str(wport)], cwd=ROOT)
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    gateway = subprocess.Popen([sys.executable, *prof, __file__, "--role", "gateway", "--port", str(gport),
                                "--worker-port", str(wport), "--tok-dir", str(tok_dir)], cwd=ROOT)
    url = f"http://127.0.0.1:{gport}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(400):
                try:
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
        direct = await direct_latency(wport, 500)
        for stream in (False, True):
            lat1, _ = await http_run(url, 500, 1, stream)
            cpu0 = cpu_seconds(gateway.pid)
            latn, rps = await http_run(url, args.requests, args.concurrency, stream)
            cpu_us = (cpu_seconds(gateway.pid) - cpu0) / (args.requests + 50) * 1e6
            print(f"stream={stream}: direct gRPC p50 {direct * 1e3:.3f} ms; via gateway c=1 p50 {lat1 * 1e3:.3f} ms "
                  f"(added {(lat1 - direct) * 1e3:.3f} ms); c={args.concurrency}: {rps:.0f} req/s, "
                  f"p50 {latn * 1e3:.2f} ms; gateway CPU {cpu_us:.0f} us/request "
                  f"(= {1e6 / cpu_us:.0f} req/s per core)")
    finally:
        for p in (gateway, worker):
            p.terminate()
            p.wait()


if __name__ == "__main__":
    if "gateway" in sys.argv:  # the gateway process runs its own loop (uvloop), outside asyncio.run
        from gateway.config import GatewayConfig
        from gateway.server import run_gateway

        a = sys.argv
        run_gateway(GatewayConfig(port=int(a[a.index("--port") + 1]),
                                  workers=(f"127.0.0.1:{a[a.index('--worker-port') + 1]}",),
                                  model_path=a[a.index("--tok-dir") + 1], log_level="warning"))
    else:
        asyncio.run(main())
