"""Process doubles for the local launcher's tests (run as scripts, in their own processes).

    python proc_double.py grpc --port P --status SERVING|NOT_SERVING
                          [--exit-after S [--exit-code N]]
                          [--cluster-id C --role R --replica I --model M]
        a real grpc.health.v1 server and the Worker service's GetInfo (that identity), like a
        worker's; optionally exits (code 7, or N: 0 is a worker that drained) after S s
    python proc_double.py http --port P
        answers GET /health with 200, like the gateway
    python proc_double.py crash --code N
        prints a line to its log and exits at once with status N

Each one prints its pid and mode so the tests can check what ran, and exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: find `protocol`


def _stop_on_sigterm(stop: threading.Event) -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())


def run_grpc(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from protocol import tandem_pb2, tandem_pb2_grpc

    port, status, exit_after = args.port, args.status, args.exit_after
    info = tandem_pb2.WorkerInfo(
        cluster_id=args.cluster_id,
        role=args.role,
        replica=args.replica,
        model_fingerprint=args.model,
    )

    class Info(tandem_pb2_grpc.WorkerServicer):
        def GetInfo(self, request, context):  # noqa: N802 (gRPC method name)
            return info

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tandem_pb2_grpc.add_WorkerServicer_to_server(Info(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    servicer.set("", health_pb2.HealthCheckResponse.ServingStatus.Value(status))
    server.start()
    print(f"grpc double pid={os.getpid()} port={port} status={status}", flush=True)
    stop = threading.Event()
    _stop_on_sigterm(stop)
    if exit_after > 0 and not stop.wait(exit_after):
        print("grpc double: exiting on purpose", flush=True)
        server.stop(0)
        return int(args.exit_code)
    stop.wait()
    server.stop(0)
    print("grpc double: stopped by SIGTERM", flush=True)
    return 0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def run_http(port: int) -> int:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"http double pid={os.getpid()} port={port}", flush=True)
    stop = threading.Event()
    _stop_on_sigterm(stop)
    stop.wait()
    server.shutdown()
    print("http double: stopped by SIGTERM", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    g = sub.add_parser("grpc")
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--status", default="SERVING")
    g.add_argument("--exit-after", type=float, default=0.0)
    g.add_argument("--exit-code", type=int, default=7)
    g.add_argument("--cluster-id", default="")
    g.add_argument("--role", default="")
    g.add_argument("--replica", type=int, default=0)
    g.add_argument("--model", default="")
    h = sub.add_parser("http")
    h.add_argument("--port", type=int, required=True)
    c = sub.add_parser("crash")
    c.add_argument("--code", type=int, default=3)
    args = p.parse_args()
    if args.mode == "grpc":
        return run_grpc(args)
    if args.mode == "http":
        return run_http(args.port)
    print("crash double: failing at start-up: model weights not found (on purpose)", flush=True)
    return args.code


if __name__ == "__main__":
    sys.exit(main())
