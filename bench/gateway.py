"""Gateway overhead bench (not a test): added latency at concurrency 1, req/s at concurrency N,
for our gateway (mono and PD) and, on the same mock workers with the same load generator, the
Rust PD routers (sglang-router, smg, vllm-router) where they are installed.

    .venv/bin/python -m bench.gateway --requests 3000 --concurrency 32
    .venv/bin/python -m bench.gateway --streamed-at 1,8,32,96   # CPU a streamed token vs c,
                                                                # ours and the routers'

Processes: mock workers (bench/mock_worker.py: one token per request, gRPC for our gateway,
HTTP for the routers), one gateway or router at a time, and the load generator
(bench/loadgen.py: wrk if installed, else aiohttp). "added" = the median round trip through
the gateway at concurrency 1 minus the median round trip straight to the worker (gRPC
Generate for ours, from a process on the gateway's gRPC stack and event loop; HTTP for the
routers). CPU figures are the gateway's (or router's) process tree's user + system time over
the concurrency-N run. Then a streaming run (64 tokens a request, one per 2 ms "step", on the
mocks' gRPC for ours and their HTTP for the routers) gives each one's CPU per streamed token.
Install the routers for the comparison only: `.venv/bin/pip install sglang-router smg vllm-router`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import http_load  # noqa: E402
from protocol import tandem_pb2, tandem_pb2_grpc  # noqa: E402
from protocol.grpc_env import apply_grpc_env  # noqa: E402
from tests.gateway.gw_tokenizers import build_tokenizer  # noqa: E402

ROUTERS = {  # name -> argv before the PD worker flags
    "sglang-router": [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"],
    "smg": [str(Path(sys.executable).parent / "smg"), "launch", "--pd-disaggregation"],
    "vllm-router": [str(Path(sys.executable).parent / "vllm-router"),
                    "--vllm-pd-disaggregation"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu(pid: int) -> float:
    """user + system CPU seconds of a process and its live descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(d.name)] = int(fields[1])
            times[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier += kids
    return sum(times.get(p, 0.0) for p in tree)


def thread_cpu(pid: int) -> tuple[float, float, float]:
    """(user, system) CPU seconds of the process's main thread, and the CPU seconds of all its
    other threads together (grpc's poller and event-engine threads, the executor)."""
    tick = os.sysconf("SC_CLK_TCK")
    main_user = main_sys = rest = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        user, system = int(fields[11]) / tick, int(fields[12]) / tick
        if task.name == str(pid):
            main_user, main_sys = user, system
        else:
            rest += user + system
    return main_user, main_sys, rest


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` in the background, with gRPC's settings as a `tandem` process has them."""
    env = dict(os.environ)
    apply_grpc_env(env)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_mock(http_port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    """Poll until one real request answers 200 (health alone may be up before the workers)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"not ready in {timeout_s} s: {log.read_text()[-1500:]}")


async def direct_grpc(port: int, n: int) -> float:
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


def direct_baseline(port: int, n: int) -> float:
    """`direct_grpc` in a process of its own, on the gRPC stack and event loop the gateway runs
    on (its environment from `process`'s; uvloop): the round trip the gateway adds to."""
    env = dict(os.environ)
    apply_grpc_env(env)
    out = subprocess.run([sys.executable, __file__, "--role", "direct", "--port", str(port),
                          "--n", str(n)], cwd=ROOT, env=env, check=True, capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1])


def body(stream: bool, max_tokens: int = 1) -> str:
    return json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens,
                       "stream": stream})


def measure(url: str, pid: int, stream: bool, n: int, c: int, mocks: tuple[int, ...] = ()
            ) -> dict[str, float]:
    """c=1 and c=n figures through the gateway at `pid`, with its CPU a request and that of the
    mock worker processes `mocks` (the share of the box the workers' side of the protocol took)."""
    http_load(f"{url}/v1/completions", body(stream), 200, 8)  # warm-up
    one = http_load(f"{url}/v1/completions", body(stream), min(500, n), 1)
    cpu0, mock0 = tree_cpu(pid), sum(tree_cpu(m) for m in mocks)
    many = http_load(f"{url}/v1/completions", body(stream), n, c)
    per = 1e6 / max(many.count, 1)
    return {"p50_1": one.p50_s, "rps": many.rps, "p50_n": many.p50_s,
            "cpu_us": (tree_cpu(pid) - cpu0) * per,
            "mock_us": (sum(tree_cpu(m) for m in mocks) - mock0) * per,
            "failed": one.failed + many.failed}


def gateway_argv(port: int, tok_dir: Path, workers: dict[str, list[int]]) -> list[str]:
    return [sys.executable, __file__, "--role", "gateway", "--port", str(port), "--tok-dir",
            str(tok_dir), "--workers", json.dumps(workers)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--no-routers", action="store_true", help="only our gateway")
    ap.add_argument("--streamed-at", metavar="C1,C2,...",
                    help="only the streamed runs, at each of these concurrencies: ours, then "
                    "each router's (not with --no-routers)")
    args = ap.parse_args()
    n, c = args.requests, args.concurrency
    tmp = Path(tempfile.mkdtemp())
    tok_dir = build_tokenizer(tmp / "tok")
    roles = ("stream-p", "stream-d") if args.streamed_at else (
        "both", "prefill", "decode", "stream-p", "stream-d")
    ports = {r: (free_port(), free_port()) for r in roles}
    rows: dict[str, dict[str, float]] = {}
    pids: dict[str, int] = {}  # mock name -> pid
    with contextlib.ExitStack() as stack:
        for name, (gp, hp) in ports.items():
            role = name.replace("stream-p", "prefill").replace("stream-d", "decode")
            extra = ["--tokens", "64", "--step-ms", "2"] if name.startswith("stream") else []
            argv = [sys.executable, "-m", "bench.mock_worker", "--role", role, "--grpc-port",
                    str(gp), "--http-port", str(hp), *extra]
            pids[name] = stack.enter_context(process(argv, tmp / f"mock-{name}.log")).pid
        for _, hp in ports.values():
            wait_mock(hp)
        if args.streamed_at:
            streamed_sweep(tmp, tok_dir, ports, [int(at) for at in args.streamed_at.split(",")],
                           not args.no_routers)
            return
        direct = direct_baseline(ports["both"][0], 500)
        setups = {"mono": {"workers": [ports["both"][0]]},
                  "pd": {"prefill": [ports["prefill"][0]], "decode": [ports["decode"][0]]}}
        mocks = {"mono": (pids["both"],), "pd": (pids["prefill"], pids["decode"])}
        for mode, workers in setups.items():
            gport = free_port()
            log = tmp / f"gateway-{mode}.log"
            with process(gateway_argv(gport, tok_dir, workers), log) as gw:
                url = f"http://127.0.0.1:{gport}"
                wait_ready(url, gw, log)
                for stream in (False, True):
                    r = measure(url, gw.pid, stream, n, c, mocks[mode])
                    if mode == "pd" and not stream:
                        rows["tandem"] = r
                    legs = "one worker leg" if mode == "mono" else "two worker legs"
                    print(f"stream={stream}: direct gRPC p50 {direct * 1e3:.3f} ms; via gateway "
                          f"c=1 p50 {r['p50_1'] * 1e3:.3f} ms (added "
                          f"{(r['p50_1'] - direct) * 1e3:.3f} ms); c={c}: {r['rps']:.0f} req/s, "
                          f"p50 {r['p50_n'] * 1e3:.2f} ms; gateway CPU {r['cpu_us']:.0f} "
                          f"us/request, mocks' {r['mock_us']:.0f}; failed {r['failed']} "
                          f"[{mode}: {legs}]", flush=True)
        st = streamed(tmp, tok_dir, ports, c)
        rows["tandem"].update(stream_us=st["us_token"], stream_failed=st["failed"])
        if not args.no_routers:
            routers(tmp, ports, n, c, rows, (pids["prefill"], pids["decode"]))


def measure_stream(url: str, pid: int, c: int) -> dict[str, float]:
    """CPU per streamed token of the process tree at `pid` (64 tokens a request, c streams), and
    its split by thread (meaningful for our one-event-loop gateway)."""
    http_load(f"{url}/v1/completions", body(True, 64), 64, 8)  # warm-up
    cpu0, threads0 = tree_cpu(pid), thread_cpu(pid)
    r = http_load(f"{url}/v1/completions", body(True, 64), max(c * 8, 256), c)
    cpu = tree_cpu(pid) - cpu0  # the probe run included: it streams the same tokens
    user, system, rest = (b - a for a, b in zip(threads0, thread_cpu(pid), strict=True))
    per = 1e6 / (r.count * 64)
    return {"tok_s": r.rps * 64, "us_token": cpu * per, "us_request": cpu / r.count * 1e6,
            "user": user * per, "system": system * per, "rest": rest * per, "failed": r.failed}


def streamed(tmp: Path, tok_dir: Path, ports: dict[str, tuple[int, int]], c: int
             ) -> dict[str, float]:
    """Gateway CPU per streamed token: PD, 64 tokens a request, one per 2 ms step."""
    gport = free_port()
    workers = {"prefill": [ports["stream-p"][0]], "decode": [ports["stream-d"][0]]}
    log = tmp / "gateway-stream.log"
    with process(gateway_argv(gport, tok_dir, workers), log) as gw:
        url = f"http://127.0.0.1:{gport}"
        wait_ready(url, gw, log)
        r = measure_stream(url, gw.pid, c)
    print(f"streamed 64 tokens a request (PD, 2 ms steps): c={c}: {r['tok_s']:.0f} tok/s, "
          f"gateway CPU {r['us_token']:.1f} us/token ({r['us_request']:.0f} us/request; "
          f"event-loop thread {r['user']:.1f} user + {r['system']:.1f} system, "
          f"grpc's threads {r['rest']:.1f}); failed {r['failed']:.0f}", flush=True)
    return r


def installed_routers() -> tuple[dict[str, list[str]], dict[str, str]]:
    """The routers' argv (before the PD worker flags) that can run here, and a note for each
    that cannot."""
    found, notes = {}, {}
    for name, argv in ROUTERS.items():
        if not Path(argv[0]).exists() or (name == "sglang-router"
                                           and importlib.util.find_spec("sglang_router") is None):
            notes[name] = "not installed"
        else:
            found[name] = argv
    return found, notes


@contextmanager
def router(tmp: Path, name: str, argv: list[str], ports: dict[str, tuple[int, int]], p: str,
           d: str) -> Iterator[tuple[str, int]]:
    """Router `name` on the mocks' HTTP sides of `p` and `d`, ready: its url and pid."""
    rport = free_port()
    full = [*argv, "--prefill", f"http://127.0.0.1:{ports[p][1]}", "--decode",
            f"http://127.0.0.1:{ports[d][1]}", "--host", "127.0.0.1", "--port", str(rport)]
    log = tmp / f"{name}-{p}.log"
    with process(full, log) as proc:
        url = f"http://127.0.0.1:{rport}"
        wait_ready(url, proc, log)
        yield url, proc.pid


def routers(tmp: Path, ports: dict[str, tuple[int, int]], n: int, c: int,
            rows: dict[str, dict[str, float]], mocks: tuple[int, int]) -> None:
    """The Rust PD routers on the same mock workers (HTTP), one at a time, each run twice: the
    one-token load on the plain mocks, the streamed load on the stepped ones; then one table."""
    mock_url = f"http://127.0.0.1:{ports['decode'][1]}"
    direct = http_load(f"{mock_url}/v1/completions", body(False), 500, 1).p50_s
    found, notes = installed_routers()
    for name, argv in found.items():
        try:
            with router(tmp, name, argv, ports, "prefill", "decode") as (url, pid):
                rows[name] = measure(url, pid, False, n, c, mocks)
            with router(tmp, name, argv, ports, "stream-p", "stream-d") as (url, pid):
                st = measure_stream(url, pid, c)
                rows[name].update(stream_us=st["us_token"], stream_failed=st["failed"])
        except (RuntimeError, AssertionError, subprocess.SubprocessError) as exc:
            notes[name] = f"failed: {str(exc)[-300:]}"
            rows.pop(name, None)
    print(f"\nPD path (two worker legs), same mock workers, same load generator; max_tokens=1, "
          f"non-streaming, direct HTTP to the mock p50 {direct * 1e3:.3f} ms (ours: direct "
          f"gRPC); streamed: 64 tokens a request, one per 2 ms step, c={c}\n")
    print(f"| gateway | c=1 p50 ms | c={c} req/s | c={c} p50 ms | CPU us/request | "
          "mocks' CPU us/request | CPU us/streamed token | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['p50_1'] * 1e3:.3f} | {r['rps']:.0f} | {r['p50_n'] * 1e3:.2f} | "
              f"{r['cpu_us']:.0f} | {r['mock_us']:.0f} | {r.get('stream_us', float('nan')):.1f} | "
              f"{r['failed'] + r.get('stream_failed', 0):.0f} |")
    for name, note in notes.items():
        print(f"| {name} | {note} | | | | | | |")


def streamed_sweep(tmp: Path, tok_dir: Path, ports: dict[str, tuple[int, int]],
                   concurrencies: list[int], with_routers: bool) -> None:
    """CPU per streamed token at each concurrency, ours and (unless told not to) each router's
    on the same stepped mocks; one table."""
    cells: dict[str, list[str]] = {"tandem": []}
    for c in concurrencies:
        r = streamed(tmp, tok_dir, ports, c)
        cells["tandem"].append(f"{r['us_token']:.1f} ({r['tok_s']:,.0f})")
    found, notes = installed_routers() if with_routers else ({}, {})
    for name, argv in found.items():
        try:
            with router(tmp, name, argv, ports, "stream-p", "stream-d") as (url, pid):
                cells[name] = []
                for c in concurrencies:
                    st = measure_stream(url, pid, c)
                    cells[name].append(f"{st['us_token']:.1f} ({st['tok_s']:,.0f})")
                    print(f"{name}: c={c}: {st['tok_s']:.0f} tok/s, CPU {st['us_token']:.1f} "
                          f"us/token; failed {st['failed']:.0f}", flush=True)
        except (RuntimeError, AssertionError, subprocess.SubprocessError) as exc:
            notes[name] = f"failed: {str(exc)[-300:]}"
            cells.pop(name, None)
    print("\nCPU us a streamed token (tok/s), PD, 64 tokens a request, one per 2 ms step\n")
    print("| gateway | " + " | ".join(f"c={c}" for c in concurrencies) + " |")
    print("|---|" + "---|" * len(concurrencies))
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")
    for name, note in notes.items():
        print(f"| {name} | {note} |" + " |" * (len(concurrencies) - 1))


def run_gateway_process(argv: list[str]) -> None:
    """The gateway process: run_gateway on its own loop (uvloop), outside asyncio.run."""
    from gateway.config import GatewayConfig
    from gateway.server import run_gateway

    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--port", type=int)
    ap.add_argument("--tok-dir")
    ap.add_argument("--workers")
    a = ap.parse_args(argv)
    ws = {k: tuple(f"127.0.0.1:{p}" for p in v) for k, v in json.loads(a.workers).items()}
    run_gateway(GatewayConfig(port=a.port, model_path=a.tok_dir, log_level="warning",
                              prefill_policy="round_robin", decode_policy="round_robin", **ws))


if __name__ == "__main__":
    role = sys.argv[sys.argv.index("--role") + 1] if "--role" in sys.argv else ""
    if role == "gateway":
        run_gateway_process(sys.argv[1:])
    elif role == "direct":
        import uvloop

        port, n = (int(sys.argv[sys.argv.index(f) + 1]) for f in ("--port", "--n"))
        print(uvloop.run(direct_grpc(port, n)))
    else:
        main()
