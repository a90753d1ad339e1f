"""Gateway metrics: per-worker running totals as counters, a removed worker's series, and the
event-loop histogram and counter against prometheus_client's."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from gateway.metrics import Metrics, TokenClock
from protocol import tandem_pb2


def test_a_removed_workers_series_leave_metrics() -> None:
    m = Metrics()
    load = tandem_pb2.Load(running=1, transfer_bytes=4096, transfer_pages=1)
    load.spec.draft_tokens = 3
    m.observe_load("decode", "h:1", load, healthy=True)
    m.observe_load("decode", "h:2", load, healthy=True)
    text = m.render().decode()
    assert 'tandem_worker_transfer_bytes_total{pool="decode",worker="h:1"} 4096.0' in text
    assert "# TYPE tandem_worker_transfer_bytes_total counter" in text
    m.remove_worker("decode", "h:1")
    m.remove_worker("decode", "h:9")  # never seen: nothing to do
    text = m.render().decode()
    assert 'worker="h:1"' not in text and 'worker="h:2"' in text


def test_loop_histogram_renders_what_prometheus_clients_histogram_renders() -> None:
    """The same samples, bucket edges included (a value equal to a bound counts in it), as
    prometheus_client's Histogram; only its `_created` sample is not kept."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from gateway.metrics import LoopHistogram

    bounds = (0.001, 0.01, 0.1, 1.0)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("lat_seconds", "a latency", bounds)
    ours.register(loop)
    ref = Histogram("lat_seconds", "a latency", buckets=bounds, registry=theirs)
    rng = random.Random(7)
    for v in [*bounds, 0.0, 5.0, *(rng.expovariate(20) for _ in range(500))]:
        loop.observe(v)
        ref.observe(v)
    want = [line for line in generate_latest(theirs).decode().splitlines()
            if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == want


def test_labelled_loop_histogram_renders_what_prometheus_clients_histogram_renders() -> None:
    """A LoopHistogram with labels (the queue wait per pool, observed once a request) renders
    each series as prometheus_client's labelled Histogram does, series made at zero included."""
    from prometheus_client import Histogram

    from gateway.metrics import LoopHistogram

    bounds = (0.001, 0.1)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("wait_seconds", "a wait", bounds, ("pool",))
    ours.register(loop)
    ref = Histogram("wait_seconds", "a wait", ["pool"], buckets=bounds, registry=theirs)
    for pool in ("decode", "workers"):
        loop.labels(pool)
        ref.labels(pool)
    for pool, v in (("decode", 0.0), ("decode", 0.05), ("decode", 3.0), ("prefill", 0.1)):
        loop.labels(pool).observe(v)
        ref.labels(pool).observe(v)
    want = [line for line in generate_latest(theirs).decode().splitlines()
            if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == want


def test_loop_counter_exports_what_prometheus_clients_counter_does():
    """LoopCounter (no lock per change) is exported as prometheus_client's Counter with the
    same changes: the same series, types and values (`_created` stamps apart)."""
    from gateway.metrics import LoopCounter

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopCounter("reqs", "requests by outcome", ("outcome",))
    bare = LoopCounter("toks", "tokens")
    for c in (loop, bare):
        ours.register(c)
    ref = Counter("reqs", "requests by outcome", ["outcome"], registry=theirs)
    ref_bare = Counter("toks", "tokens", registry=theirs)
    for outcome in ("success", "aborted"):  # at zero from the start, as the gateway makes them
        loop.labels(outcome)
        ref.labels(outcome)
    for outcome, n in (("success", 3), ("client_error", 2), ("success", 1.5)):
        loop.labels(outcome).inc(n)
        ref.labels(outcome).inc(n)
    bare.inc(7)
    ref_bare.inc(7)

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line.split(" ")[0] if "_created{" in line or "_created " in line else line
                for line in text.splitlines()]

    assert lines(ours) == lines(theirs)
    with pytest.raises(ValueError):
        bare.inc(-1)


def test_inter_token_latency_has_one_sample_per_token() -> None:
    """docs/metrics.md: the gap between two worker messages divided over the later one's
    tokens, one sample per token; a message of 4 tokens is 4 samples (it was 1, so the
    histogram's count fell short of the tokens streamed and its quantiles leaned on the
    messages of one token)."""
    m = Metrics()
    clock = TokenClock(m.itl, 1)
    clock.arrived(4)
    clock.arrived(1)
    clock.arrived(0)  # a message without tokens (the end): no sample
    text = m.render().decode()
    assert "tandem_inter_token_latency_seconds_count 5.0" in text


def test_tokens_that_came_with_the_first_one_are_samples_of_zero() -> None:
    """A first output of 3 tokens (PD: decode's first message holds the first token and its
    first step's, speculation more) gives 2 samples of 0: the count is the tokens after the
    first, as docs/metrics.md's one sample per token says (they gave none, so a 12-token PD
    answer counted 10 and sum / count overstated the time per output token)."""
    m = Metrics()
    TokenClock(m.itl, 3)
    text = m.render().decode()
    assert "tandem_inter_token_latency_seconds_count 2.0" in text
    assert "tandem_inter_token_latency_seconds_sum 0.0" in text
    TokenClock(m.itl, 1).arrived(2)
    assert "tandem_inter_token_latency_seconds_count 4.0" in m.render().decode()


@pytest.mark.anyio
async def test_requests_refused_before_the_handler_count_in_their_outcome(tok_dir) -> None:
    """A generation request answered 401 (API key) or 503 (no worker has answered yet) is a
    finished request: tandem_requests_total counts it (it counted neither, so a client with a
    wrong key, or a gateway whose workers never came up, showed no request at all)."""
    from tests.gateway.gw_doubles import ScriptedWorker, fast_config, running_app, workers

    admin = {"Authorization": "Bearer adm"}
    w = ScriptedWorker()
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,), api_key="sekret",
                                                   admin_key="adm")) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert (await c.post(path, json={"prompt": "a"})).status_code == 401
        text = (await c.get("/metrics", headers=admin)).text
        assert 'tandem_requests_total{outcome="client_error"} 2.0' in text
    nobody = fast_config(tok_dir, workers=("127.0.0.1:1",), startup_wait_s=0.0)
    async with running_app(nobody) as c:
        r = await c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503
        text = (await c.get("/metrics")).text
        assert 'tandem_requests_total{outcome="server_error"} 1.0' in text
