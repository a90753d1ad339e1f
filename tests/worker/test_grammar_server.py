"""Constrained decoding through the worker's gRPC server (embedded model, role both): outputs
match their grammar, bad grammars and biases are INVALID_ARGUMENT naming the field, and a
cancelled constrained stream leaves no page behind."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import tandem_pb2, tandem_pb2_grpc
from tests.worker.grammar_helpers import EMBEDDED, SCHEMAS, Case, check_output, prompt, tokenizer
from tests.worker.test_server import free_port
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.sampling import StructuredKind, StructuredOutput
from worker.server import serve

TOK = tokenizer()


@pytest.fixture(scope="module")
def stub() -> Iterator[tandem_pb2_grpc.WorkerStub]:
    config = WorkerConfig(
        port=free_port(),
        model=ModelConfig(path=str(EMBEDDED.parent)),
        cache=CacheConfig(page_size=16, num_pages=128),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=256),
        num_threads=1,
    )
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=lambda: loop.run_until_complete(serve(config, stop)),
                              daemon=True)
    thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{config.port}")
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for _ in range(600):
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == serving:
                break
        except grpc.RpcError:
            pass
        threading.Event().wait(0.05)
    else:
        raise AssertionError("worker never became SERVING")
    yield tandem_pb2_grpc.WorkerStub(channel)
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=20)
    channel.close()


def generate(structured: tandem_pb2.StructuredOutput | None = None, **sampling: object,
             ) -> tandem_pb2.GenerateRequest:
    params = tandem_pb2.SamplingParams(max_tokens=200, **sampling)  # type: ignore[arg-type]
    if structured is not None:
        params.structured.CopyFrom(structured)
    return tandem_pb2.GenerateRequest(request_id="g", prompt_token_ids=prompt(TOK),
                                      sampling=params)


def text_of(msgs: list[tandem_pb2.GenerateResponse]) -> tuple[str, str]:
    tokens = [t for m in msgs for t in m.token_ids if t != 2]
    return TOK.decode(tokens, skip_special_tokens=False), msgs[-1].finish_reason


def test_constrained_output_over_grpc(stub: tandem_pb2_grpc.WorkerStub) -> None:
    schema = json.dumps(SCHEMAS["nested"])
    for seed in (None, 7):
        extra = {} if seed is None else {"temperature": 1.0, "seed": seed}
        text, finish = text_of(list(stub.Generate(generate(
            tandem_pb2.StructuredOutput(json_schema=schema), **extra))))
        assert finish == "stop"
        check_output(Case("s", StructuredOutput(StructuredKind.JSON_SCHEMA, schema)), text)
    choices = tandem_pb2.StructuredOutput(choice=tandem_pb2.ChoiceList(choices=["left", "right"]))
    text, finish = text_of(list(stub.Generate(generate(choices))))
    assert finish == "stop" and text in ("left", "right")


@pytest.mark.parametrize(("structured", "sampling", "fragment"), [
    (tandem_pb2.StructuredOutput(json_schema="{oops"), {}, "sampling.structured.json_schema: "),
    (tandem_pb2.StructuredOutput(json_schema='{"type": "nope"}'), {},
     "sampling.structured.json_schema: cannot be compiled"),
    (tandem_pb2.StructuredOutput(regex="[a-"), {}, "sampling.structured.regex: "),
    (tandem_pb2.StructuredOutput(ebnf="root ::= x"), {}, "sampling.structured.ebnf: "),
    (tandem_pb2.StructuredOutput(structural_tag="{}"), {}, "sampling.structured.structural_tag: "),
    (tandem_pb2.StructuredOutput(choice=tandem_pb2.ChoiceList()), {},
     "sampling.structured.choice: is empty"),
    (tandem_pb2.StructuredOutput(json_object=False), {}, "sampling.structured.json_object: "),
    (tandem_pb2.StructuredOutput(), {}, "sampling.structured: no kind is set"),
    (None, {"logit_bias": {5000: 1.0}}, "sampling.logit_bias: token ids out of the vocabulary"),
    (None, {"logit_bias": {5: 101.0}}, "sampling.logit_bias: biases must be in [-100, 100]"),
])
def test_bad_grammars_and_biases_are_invalid_argument(
        stub: tandem_pb2_grpc.WorkerStub, structured: tandem_pb2.StructuredOutput | None,
        sampling: dict[str, object], fragment: str) -> None:
    request = generate(**sampling)
    if structured is not None:
        request.sampling.structured.CopyFrom(structured)
        request.sampling.structured.SetInParent()  # an empty message still counts as sent
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details(), err.value.details()


def test_cancelled_constrained_stream_frees_its_pages(stub: tandem_pb2_grpc.WorkerStub) -> None:
    endless = tandem_pb2.StructuredOutput(regex="(ab)+")
    stream = stub.Generate(generate(endless, ignore_eos=True))
    next(stream)
    stream.cancel()
    for _ in range(200):
        load = stub.GetLoad(tandem_pb2.GetLoadRequest())
        if load.kv_used_pages == 0 and load.running == 0:
            break
        threading.Event().wait(0.02)
    assert load.kv_used_pages == 0 and load.running == 0 and load.waiting == 0


def test_constrained_requests_on_the_session_stream(stub: tandem_pb2_grpc.WorkerStub) -> None:
    """The gateway's path: the grammar compiles off the event loop, then the request runs; a
    bad grammar ends its slot alone with INVALID_ARGUMENT; a slot aborted while its grammar
    compiles ends with finish_reason abort and never reaches the engine."""
    from tests.worker.test_session import Stream, wait_idle

    schema = json.dumps(SCHEMAS["nested"])
    s = Stream(stub)
    s.submit((1, generate(tandem_pb2.StructuredOutput(json_schema=schema))),
             (2, generate(tandem_pb2.StructuredOutput(regex="[a-"))))
    endless = generate(tandem_pb2.StructuredOutput(regex="(cd)+"), ignore_eos=True)
    s.send(tandem_pb2.SessionRequest(  # submitted and aborted in one frame
        submits=[tandem_pb2.Submit(slot=3, request=endless)],
        aborts=[tandem_pb2.SessionAbort(slot=3)]))
    s.read_until({1, 2, 3})
    s.close()
    text = TOK.decode([t for t in s.tokens[1] if t != 2], skip_special_tokens=False)
    assert s.ended[1].finish_reason == "stop"
    check_output(Case("s", StructuredOutput(StructuredKind.JSON_SCHEMA, schema)), text)
    assert s.ended[2].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sampling.structured.regex: " in s.ended[2].error
    assert s.ended[3].finish_reason == "abort" and 3 not in s.tokens and 3 not in s.started
    assert wait_idle(stub).kv_used_pages == 0
