"""tandem_spec_*: speculative decoding figures, mirrored from each worker's GetLoad totals.

Workers keep monotonic totals (drafted, accepted, verify steps, draft and verify time, and how
many request-steps accepted 0, 1, ..., k drafts); the gateway exports the latest snapshot of
each worker as counters and a histogram, so every request counts however it ended (a stop
string or a disconnect aborts a request before its final message, never before its steps).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from protocol import tandem_pb2

_LABELS = ["pool", "worker"]


class SpecCollector(Collector):
    def __init__(self) -> None:
        self._loads: dict[tuple[str, str], tandem_pb2.SpecLoad] = {}

    def observe(self, pool: str, url: str, load: tandem_pb2.Load) -> None:
        if load.HasField("spec"):
            self._loads[(pool, url)] = load.spec

    def forget(self, pool: str, url: str) -> None:
        self._loads.pop((pool, url), None)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        counters = {
            "draft_tokens": ("Draft tokens proposed and verified", "draft_tokens"),
            "accepted_tokens": ("Draft tokens the target accepted", "accepted_tokens"),
            "verify_steps": ("Engine steps that verified drafts", "verify_steps"),
            "draft_seconds": ("Host time spent drafting", "draft_seconds"),
            "verify_seconds": ("Time of the steps that verified drafts", "verify_seconds"),
        }
        for name, (doc, field) in counters.items():
            family = CounterMetricFamily(f"tandem_spec_{name}", doc, labels=_LABELS)
            for (pool, url), spec in self._loads.items():
                family.add_metric([pool, url], float(getattr(spec, field)))
            yield family
        rate = GaugeMetricFamily(
            "tandem_spec_acceptance_rate",
            "Accepted / drafted tokens since the worker started",
            labels=_LABELS,
        )
        hist = HistogramMetricFamily("tandem_spec_accepted_length",
                                     "Tokens a request emits per verify step (accepted drafts + 1)",
                                     labels=_LABELS)
        for (pool, url), spec in self._loads.items():
            if spec.draft_tokens:  # no rate before the first draft (0 of 0 is not 0%)
                rate.add_metric([pool, url], spec.accepted_tokens / spec.draft_tokens)
            buckets, total = [], 0
            for accepted, n in enumerate(spec.accepted_hist):
                total += n
                buckets.append((str(float(accepted + 1)), float(total)))  # le = tokens emitted
            buckets.append(("+Inf", float(total)))
            emitted = spec.accepted_tokens + spec.request_steps
            hist.add_metric([pool, url], buckets, float(emitted))
        yield rate
        yield hist
