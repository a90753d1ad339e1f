"""Gateway metrics: per-worker running totals as counters, a removed worker's series, and the
event-loop histogram against prometheus_client's."""

from __future__ import annotations

from gateway.metrics import Metrics
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
