"""Gateway metrics: per-worker running totals as counters, and a removed worker's series."""

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
