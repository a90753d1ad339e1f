"""Grammar-constrained decoding across the PD split.

1. A real 1P1D cluster (`tandem serve`, Mooncake over loopback) driven over the workers' gRPC
   the way the gateway drives them: one GenerateRequest with `sampling.structured`, sent to both
   legs at once with one room. Greedy, its output equals a mono cluster's token for token for the
   whole grammar corpus, including grammars whose first token (sampled on prefill) is forced;
   decode never runs a prompt token, and both workers drain.
2. Two engines in this process (prefill and decode, real transfer) where the matchers can be
   counted: a constrained request aborted while its room is in flight or while it decodes, or
   whose room's writes fail, leaves no matcher and no page on either worker.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from orchestrator.launch.background import Cluster, running_cluster
from protocol import tandem_pb2, tandem_pb2_grpc
from tests.worker.grammar_helpers import (
    EMBEDDED,
    MAX_TOKENS,
    Case,
    check_output,
    corpus,
    logit_bias,
    prompt,
    tokenizer,
)
from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, RequestOutput
from worker.request import Request
from worker.roles import attach
from worker.sampling import SamplingParams, StructuredKind, StructuredOutput

pytestmark = pytest.mark.slow

TOK = tokenizer()
EOS = 2
# First tokens forced by the grammar itself: prefill has one choice, decode must accept it.
FORCED = [Case("forced:choice", StructuredOutput(StructuredKind.CHOICE, choices=("n=60;",))),
          Case("forced:regex", StructuredOutput(StructuredKind.REGEX, r"x=[0-9]{2};"))]
PROMPTS = ["m=87;y=42;n=60;\nm,n?", "a=11;b=22;\nb?"]


def to_proto(s: StructuredOutput) -> tandem_pb2.StructuredOutput:
    if s.kind is StructuredKind.CHOICE:
        return tandem_pb2.StructuredOutput(choice=tandem_pb2.ChoiceList(choices=list(s.choices)))
    if s.kind is StructuredKind.JSON_OBJECT:
        return tandem_pb2.StructuredOutput(json_object=True)
    return tandem_pb2.StructuredOutput(**{s.kind.value: s.text})


def request_for(case: Case, text: str, rid: str) -> tandem_pb2.GenerateRequest:
    sampling = tandem_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         structured=to_proto(case.structured),
                                         logit_bias=dict(logit_bias(TOK, case)))
    return tandem_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt(TOK, text),
                                      sampling=sampling)


def stream_tokens(addr: str, request: tandem_pb2.GenerateRequest) -> tuple[list[int], str]:
    with grpc.insecure_channel(addr) as ch:
        msgs = list(tandem_pb2_grpc.WorkerStub(ch).Generate(request, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


def generate_mono(cluster: Cluster, request: tandem_pb2.GenerateRequest) -> list[int]:
    tokens, finish = stream_tokens(cluster.workers["both-0"], request)
    assert finish == "stop"
    return tokens


def generate_pd(cluster: Cluster, request: tandem_pb2.GenerateRequest, bootstrap: str) -> list[int]:
    """What the gateway does: one room, the same GenerateRequest to both legs at once."""
    pd = tandem_pb2.GenerateRequest()
    pd.CopyFrom(request)
    pd.disagg.room = secrets.randbits(64) or 1
    pd.disagg.bootstrap_addr = bootstrap
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(stream_tokens, cluster.workers["prefill-0"], pd)
        decode = pool.submit(stream_tokens, cluster.workers["decode-0"], pd)
        first, _ = prefill.result()
        tokens, finish = decode.result()
    assert finish == "stop" and tokens[:1] == first[:1]  # decode streams prefill's first token
    return tokens


@pytest.fixture(scope="module")
def mono(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster("configs/tiny-mono.yaml", tmp=tmp_path_factory.mktemp("mono")) as c:
        yield c


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path_factory.mktemp("pd")) as c:
        yield c


def test_greedy_pd_equals_mono_under_every_grammar(mono: Cluster, pd: Cluster) -> None:
    with grpc.insecure_channel(pd.workers["prefill-0"]) as ch:
        info = tandem_pb2_grpc.WorkerStub(ch).GetInfo(tandem_pb2.GetInfoRequest())
    bootstrap = info.bootstrap_addr
    cases = corpus() + FORCED
    jobs = [(c, text, f"{c.name}#{i}") for c in cases for i, text in enumerate(PROMPTS)]
    with ThreadPoolExecutor(8) as pool:  # concurrent, as a gateway would send them
        ref = list(pool.map(lambda j: generate_mono(mono, request_for(*j)), jobs))
        got = list(pool.map(lambda j: generate_pd(pd, request_for(*j), bootstrap), jobs))
    for (case, _, rid), want, have in zip(jobs, ref, got, strict=True):
        assert have == want, f"{rid}: PD {TOK.decode(have)!r} != mono {TOK.decode(want)!r}"
        text = TOK.decode([t for t in have if t != EOS], skip_special_tokens=False)
        if case.name == "forced:choice":
            assert text == "n=60;"
        elif case.name == "forced:regex":
            assert text.startswith("x=") and text.endswith(";")
        else:
            check_output(case, text)
    loads = pd.wait_drained()
    assert loads["decode-0"].prompt_tokens_computed == 0, "decode ran prompt tokens"
    assert loads["prefill-0"].transfer_pages == loads["decode-0"].transfer_pages > 0
    mono.wait_drained()


# ---- two engines in this process: matchers and pages on every path --------------------------
@pytest.mark.parametrize("field,body", [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"b": {"$ref": "#/$defs/no"}}}}}}),
    ("guided_regex", {"guided_regex": "b=(4"}),
])
def test_a_grammar_the_workers_refuse_is_a_400_naming_the_request_field(
        mono: Cluster, pd: Cluster, field: str, body: dict[str, object]) -> None:
    """Only the worker compiles the grammar; its refusal reaches the client as the field the
    client sent (not the wire field, not the worker's address), from either topology."""
    for cluster in (mono, pd):
        r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "a=3;\na?"}], "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "invalid_grammar", err
        assert err["message"].startswith(f"{field}: cannot be compiled"), err
        assert "sampling." not in err["message"] and "worker" not in err["message"], err
    pd.wait_drained()
    mono.wait_drained()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(role: str) -> WorkerConfig:
    return WorkerConfig(
        role=role,  # type: ignore[arg-type]
        port=_free_port(),
        model=ModelConfig(path=str(EMBEDDED.parent), dtype="float32"),
        cache=CacheConfig(page_size=16, num_pages=128, enable_prefix_cache=role != "decode"),
        scheduler=SchedulerConfig(max_num_seqs=8, chunked_prefill_size=256),
        transfer=TransferConfig(backend="mooncake", protocol="tcp",  # type: ignore[arg-type]
                                transfer_timeout_s=5.0),
        num_threads=1,
    )


@dataclass
class Worker:
    engine: Engine
    info: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def running(role: str) -> Iterator[Worker]:
    config = _config(role)
    engine = Engine(config)
    worker = Worker(engine)
    engine.set_hooks(attach(engine, config, worker.info))
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=30)
        assert engine.hooks is not None
        engine.hooks.close()


@dataclass
class Leg:
    tokens: list[int] = field(default_factory=list)
    finish: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, out: RequestOutput) -> None:
        self.tokens.extend(out.token_ids)
        if out.finished:
            self.finish = out.finish_reason
            self.done.set()


def submit_pd(prefill: Worker, decode: Worker, structured: StructuredOutput, rid: str,
              max_tokens: int = 200) -> tuple[Leg, Leg]:
    room = secrets.randbits(64) or 1
    addr = prefill.info["bootstrap_addr"]
    # ignore_eos and eos pushed down: an endless grammar stays endless until the abort.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured=structured, logit_bias=((EOS, -100.0),))
    pre, dec = Leg(), Leg()
    for worker, leg in ((prefill, pre), (decode, dec)):
        worker.engine.grammars.compile(structured)  # the server's submit-time compile
        worker.engine.submit(Request(rid, prompt(TOK), params, room=room, bootstrap_addr=addr),
                             leg.sink)
    return pre, dec


def _drained(worker: Worker) -> None:
    """No matcher, no page, no room held: polled, since the loop thread frees them."""
    sched, hooks = worker.engine.scheduler, worker.engine.hooks
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = sched.has_work or (hooks is not None and hooks.has_work())
        if not busy and worker.engine.grammars.num_live == 0:
            with contextlib.suppress(AssertionError):
                sched.assert_drained()
                return
        time.sleep(0.05)
    assert worker.engine.grammars.num_live == 0, "a matcher outlived its request"
    sched.assert_drained()


def test_abort_or_failure_of_a_constrained_request_frees_matchers_and_pages() -> None:
    endless = StructuredOutput(StructuredKind.REGEX, "(ab)+")
    with running("prefill") as prefill, running("decode") as decode:
        manager = prefill.engine.scheduler.hooks.manager  # type: ignore[union-attr]
        # 1. Aborted on decode while its room is in flight (prefill's writes delayed).
        manager.faults = TransferFaults(delay_ms=300)
        pre, dec = submit_pd(prefill, decode, endless, "in-flight")
        time.sleep(0.1)
        decode.engine.abort("in-flight", "client left")
        assert dec.done.wait(30) and pre.done.wait(30) and dec.finish == "abort"
        manager.faults = TransferFaults()
        # 2. Aborted while decoding: the decode matcher has taken the first token and more.
        pre, dec = submit_pd(prefill, decode, endless, "decoding", max_tokens=400)
        deadline = time.monotonic() + 30
        while len(dec.tokens) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.engine.grammars.num_live == 1 and len(dec.tokens) >= 8
        decode.engine.abort("decoding", "client left")
        assert dec.done.wait(30) and dec.finish == "abort"
        assert TOK.decode(dec.tokens).startswith("abab")
        # 3. A room whose writes fail: both legs fail, and both matchers go.
        manager.faults = TransferFaults(fail=1.0)
        pre, dec = submit_pd(prefill, decode, endless, "failed")
        assert dec.done.wait(30) and pre.done.wait(30)
        assert dec.finish == pre.finish == "error"
        manager.faults = TransferFaults()
        # 4. And a constrained request still runs to its end across the split.
        choice = StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no"))
        pre, dec = submit_pd(prefill, decode, choice, "fine", max_tokens=8)
        assert dec.done.wait(30)
        assert TOK.decode(dec.tokens).split("<|endoftext|>")[0] in ("yes", "no")
        assert decode.engine.scheduler.prompt_tokens_computed == 0
        _drained(prefill)
        _drained(decode)
