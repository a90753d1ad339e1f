"""The worker front's work per engine step against the number of requests in the step.

    .venv/bin/python -m bench.front

For B requests decoding one token each: the Session front's per-step work (one
`SessionResponse` filled from the step's columns by `worker.session.fill_response`, then
serialized, as grpc does before the write) against the per-request path it replaces (one
`GenerateResponse` per request built by `worker.server.to_message`, serialized, each behind
its own event-loop hop). Process time per step, best of 5 runs of 2,000 steps.
"""

from __future__ import annotations

import time

from protocol import tandem_pb2
from worker.outputs import RequestOutput, StepOutputs
from worker.server import to_message
from worker.session import fill_response


def step(b: int) -> StepOutputs:
    return StepOutputs(tags=list(range(1, b + 1)), num_tokens=[1] * b,
                       token_ids=list(range(1000, 1000 + b)), num_logprobs=[0] * b)


def best(fn, steps: int = 2000) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(5):
        t = time.process_time()
        for _ in range(steps):
            fn()
        times.append((time.process_time() - t) / steps)
    return min(times)


def main() -> None:
    print("| B | Session front us/step | per request us/step (Generate) | us per request |")
    print("|---|---|---|---|")
    for b in (1, 16, 64, 160, 256):
        batch = step(b)
        outs = [RequestOutput(f"r{i}", [1000 + i]) for i in range(b)]

        def session(batch: StepOutputs = batch) -> None:
            msg = tandem_pb2.SessionResponse()
            fill_response(msg, batch)
            msg.SerializeToString()

        def per_request(outs: list[RequestOutput] = outs) -> None:
            for o in outs:
                to_message(o).SerializeToString()

        new, old = best(session) * 1e6, best(per_request) * 1e6
        print(f"| {b} | {new:.1f} | {old:.1f} | {new / b:.2f} vs {old / b:.2f} |")


if __name__ == "__main__":
    main()
