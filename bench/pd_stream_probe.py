"""When do a 1P1D request's tokens leave the decode worker? (a probe, not a test)

    .venv/bin/python -m bench.pd_stream_probe [--runs 5] [--max-tokens 30]

Starts configs/tiny-1p1d.yaml, then drives one room at a time straight over gRPC (as the
gateway does: Generate to prefill and decode at once, with the room) and stamps every message
of both legs. Found on the dev box (2026-12-01, issue 19): in some runs decode's messages are
held back and then all leave within a millisecond, at the moment prefill's leg ends, e.g.

    prefill [(11.4 ms, first token), (57.4 ms, 'stop')]   decode: 29 messages at 57.5-58.1 ms
    prefill [(9.8, first token), (17.9, 'stop')]  decode: 1 message at 13.9, 28 at 44.2-44.8

so the client sees TTFT ~ E2E and an ITL of ~0 ms (what `tandem bench` reports as ITL p50
0.01 ms for 1P1D at c=1); in other runs the tokens stream ~1.1 ms apart. The gateway is not
involved (this probe bypasses it). With `--max-tokens 200` the stream flows (~1.1-1.5 ms per
token) with stalls of 30-100 ms now and then (in 4 of 15 requests): a short request fits in one
stall. With `--set transfer.backend=nixl` every 30-token request was one burst. py-spy showed
decode's asyncio thread idle in epoll and its engine thread stepping meanwhile; suspected: the
event loop thread waiting on the GIL while the engine thread runs back-to-back steps (DESIGN.md's
"engine core apart from the network" is the cure). Printed per run: prefill's messages (ms, ids,
finish) and decode's first and last three messages (ms, tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.launch.background import running_cluster  # noqa: E402
from protocol import tandem_pb2, tandem_pb2_grpc  # noqa: E402


async def probe(prefill: str, decode: str, runs: int, max_tokens: int) -> None:
    async with grpc.aio.insecure_channel(prefill) as pc, grpc.aio.insecure_channel(decode) as dc:
        ps, ds = tandem_pb2_grpc.WorkerStub(pc), tandem_pb2_grpc.WorkerStub(dc)
        info = await ps.GetInfo(tandem_pb2.GetInfoRequest())
        for _ in range(runs):
            req = tandem_pb2.GenerateRequest(
                request_id="probe", prompt_token_ids=[3 + i % 100 for i in range(160)],
                sampling=tandem_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                disagg=tandem_pb2.DisaggParams(room=random.getrandbits(63) + 1,
                                               bootstrap_addr=info.bootstrap_addr))
            t0 = time.perf_counter()

            def ms(t0: float = t0) -> float:
                return round((time.perf_counter() - t0) * 1000, 1)

            async def leg(call: object, full: bool) -> list[tuple[float, object, str]]:
                return [(ms(), list(m.token_ids) if full else len(m.token_ids), m.finish_reason)
                        async for m in call]  # type: ignore[attr-defined]

            p_msgs, d_msgs = await asyncio.gather(leg(ps.Generate(req), True),
                                                  leg(ds.Generate(req), False))
            print(f"prefill {p_msgs}  decode {d_msgs[:3]} ... {d_msgs[-3:]} ({len(d_msgs)} msgs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. transfer.backend=nixl")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            running_cluster("configs/tiny-1p1d.yaml", *args.sets, tmp=Path(tmp)) as c:
        asyncio.run(probe(c.workers["prefill-0"], c.workers["decode-0"], args.runs,
                          args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
