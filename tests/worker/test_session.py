"""The worker's Session stream: many requests on one stream, one message per engine step,
per-slot errors, abort by slot / id / room, and a stream that ends frees what it carried."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest

from protocol import tandem_pb2, tandem_pb2_grpc
from tests.worker.test_server import frozen, gen, worker  # noqa: F401 (the module's worker fixture)

Worker = tuple[tandem_pb2_grpc.WorkerStub, grpc.Channel]


class Stream:
    """A Session call driven from a test: `send` frames, `read` messages until slots end."""

    def __init__(self, stub: tandem_pb2_grpc.WorkerStub) -> None:
        self._frames: queue.Queue[tandem_pb2.SessionRequest | None] = queue.Queue()
        self.call = stub.Session(self._iter(), timeout=30)
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[tandem_pb2.TokenLogprob]] = {}
        self.started: dict[int, tandem_pb2.RequestStart] = {}
        self.ended: dict[int, tandem_pb2.RequestEnd] = {}
        self.messages = 0

    def _iter(self) -> Iterator[tandem_pb2.SessionRequest]:
        while (frame := self._frames.get()) is not None:
            yield frame

    def send(self, frame: tandem_pb2.SessionRequest) -> None:
        self._frames.put(frame)

    def submit(self, *reqs: tuple[int, tandem_pb2.GenerateRequest]) -> None:
        self._frames.put(tandem_pb2.SessionRequest(
            submits=[tandem_pb2.Submit(slot=s, request=r) for s, r in reqs]))

    def abort(self, **fields: object) -> None:
        self._frames.put(tandem_pb2.SessionRequest(aborts=[tandem_pb2.SessionAbort(**fields)]))

    def read_until(self, slots: set[int]) -> None:
        """Read messages until every slot in `slots` has ended."""
        while not slots <= set(self.ended):
            msg = next(self.call)
            self.messages += 1
            pos = lpos = 0
            for slot, n, nl in zip(msg.slots, msg.num_tokens, msg.num_logprobs, strict=True):
                self.tokens.setdefault(slot, []).extend(msg.token_ids[pos:pos + n])
                self.logprobs.setdefault(slot, []).extend(msg.logprobs[lpos:lpos + nl])
                pos, lpos = pos + n, lpos + nl
            assert pos == len(msg.token_ids) and lpos == len(msg.logprobs)
            for s in msg.started:
                assert s.slot not in self.started and s.slot not in self.ended
                self.started[s.slot] = s
            for e in msg.ended:
                assert e.slot not in self.ended
                self.ended[e.slot] = e

    def close(self) -> None:
        self._frames.put(None)


def wait_idle(stub: tandem_pb2_grpc.WorkerStub) -> tandem_pb2.Load:
    for _ in range(250):
        load = stub.GetLoad(tandem_pb2.GetLoadRequest())
        if load.kv_used_pages == 0 and load.running == 0 and load.waiting == 0:
            return load
        threading.Event().wait(0.02)
    return load


def test_many_requests_share_one_stream_and_match_generate(worker: Worker) -> None:  # noqa: F811
    stub, _ = worker
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [3, 1, 4, 1, 5]]
    want = [[t for m in stub.Generate(gen(p, max_tokens=6)) for t in m.token_ids] for p in prompts]
    s = Stream(stub)
    s.submit(*((i + 1, gen(p, max_tokens=6, logprobs=i == 0, top_logprobs=2 if i == 0 else 0))
               for i, p in enumerate(prompts)))
    s.read_until({1, 2, 3, 4})
    s.close()
    assert [s.tokens[i + 1] for i in range(4)] == want  # greedy: the same tokens as Generate
    assert all(e.finish_reason == "length" and e.status_code == 0 for e in s.ended.values())
    assert s.started[1].num_prompt_tokens == 6 and s.started[2].num_prompt_tokens == 3
    assert [lp.token_id for lp in s.logprobs[1]] == want[0]
    assert all(len(lp.top) == 2 for lp in s.logprobs[1]) and not s.logprobs[2]
    # Outputs are batched per step: 24 tokens of 4 requests decoding together in far fewer
    # messages than one per token.
    assert s.messages < 24 / 2
    assert wait_idle(stub).kv_used_pages == 0


def test_bad_submit_ends_alone_with_its_status(worker: Worker) -> None:  # noqa: F811
    stub, _ = worker
    s = Stream(stub)
    s.submit((5, gen([])), (6, gen([1, 2, 500])), (7, gen([1, 2, 3], max_tokens=3)))
    s.read_until({5, 6, 7})
    s.close()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert s.ended[5].status_code == invalid and "empty" in s.ended[5].error
    assert s.ended[6].status_code == invalid and "vocabulary" in s.ended[6].error
    assert s.ended[7].status_code == 0 and len(s.tokens[7]) == 3


@pytest.mark.parametrize("how", ["slot", "request_id"])
def test_abort_on_the_stream_is_immediate_and_idempotent(
        worker: Worker, how: str) -> None:  # noqa: F811
    stub, _ = worker
    s = Stream(stub)
    long = tandem_pb2.GenerateRequest(request_id="long-one", prompt_token_ids=[3, 4, 5],
                                      sampling=tandem_pb2.SamplingParams(max_tokens=55,
                                                                         ignore_eos=True))
    s.submit((1, long), (2, gen([1, 2], max_tokens=2)))
    s.read_until({2})
    s.abort(**({"slot": 1} if how == "slot" else {"request_id": "long-one"}))
    s.abort(slot=1, request_id="long-one", room=12345)  # again, and an unknown room: fine
    s.abort(slot=99)  # an unknown slot: fine
    s.read_until({1})
    s.close()
    assert s.ended[1].finish_reason == "abort" and len(s.tokens.get(1, [])) < 55
    assert wait_idle(stub).kv_used_pages == 0


def test_a_stream_that_ends_aborts_what_it_carried(worker: Worker) -> None:  # noqa: F811
    stub, _ = worker
    s = Stream(stub)
    s.submit(*((i, gen([1, 2, 3, i], max_tokens=50)) for i in range(1, 4)))
    next(s.call)  # running
    s.call.cancel()  # the gateway vanished
    load = wait_idle(stub)
    assert load.kv_used_pages == 0 and load.running == 0


def test_the_front_does_the_same_python_work_per_step_whatever_the_batch() -> None:
    """fill_response: a step of 160 decodes costs the same Python calls as a step of 16 (the
    columns move by C-level extends; only starts, ends and logprobs are per request)."""
    import sys

    from worker.outputs import StepOutputs
    from worker.session import fill_response

    def calls(b: int) -> int:
        out = StepOutputs(tags=list(range(b)), num_tokens=[1] * b, token_ids=[7] * b,
                          num_logprobs=[0] * b)
        count = 0

        def prof(frame: object, event: str, arg: object) -> None:
            nonlocal count
            count += event in ("call", "c_call")

        sys.setprofile(prof)
        try:
            fill_response(tandem_pb2.SessionResponse(), out)
        finally:
            sys.setprofile(None)
        return count

    assert calls(160) == calls(16) == calls(1)


def test_an_attempts_abort_ends_only_that_attempt(worker: Worker) -> None:  # noqa: F811
    """The gateway's retry runs under the same request id: a late abort of attempt 0 must not
    end attempt 1 on this worker; the request id alone still ends every attempt."""
    stub, _ = worker
    s = Stream(stub)

    def attempt(n: int) -> tandem_pb2.GenerateRequest:
        return tandem_pb2.GenerateRequest(
            request_id="rq", attempt_id=f"rq/{n}", prompt_token_ids=[3, 4, 5, n],
            sampling=tandem_pb2.SamplingParams(max_tokens=40, ignore_eos=True))

    s.submit((1, attempt(0)), (2, attempt(1)), (3, attempt(2)))
    s.abort(request_id="rq", attempt_id="rq/0")  # a later frame: after the submits
    s.read_until({1})
    s.abort(request_id="rq", attempt_id="rq/0")  # late and again: ends nothing else
    s.read_until({2})  # attempt 1 ran to its end
    s.close()
    assert s.ended[1].finish_reason == "abort" and len(s.tokens.get(1, [])) < 40
    assert s.ended[2].finish_reason == "length" and len(s.tokens[2]) == 40
    s2 = Stream(stub)
    s2.submit((1, attempt(3)), (2, attempt(4)))
    s2.abort(request_id="rq")  # no attempt id: every attempt of the request
    s2.read_until({1, 2})
    s2.close()
    assert all(e.finish_reason == "abort" for e in s2.ended.values())
    assert wait_idle(stub).kv_used_pages == 0
