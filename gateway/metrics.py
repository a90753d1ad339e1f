"""Prometheus metrics of one gateway app (its own registry; nothing at module level).

Latency histograms (TTFT, inter-token, end-to-end), request outcomes, token counters, KV
transfer figures (per request from the prefill leg's last message, which every PD request
reads however it ends; each worker's running totals from GetLoad, as counters), bootstrap
failures, and per-worker queue gauges. Partial failure (docs/reliability.md): faults charged
to each worker, legs that ended "abort" unasked, streams cut by the stall deadline, and the
gateway's own queue of requests waiting for a decode seat (depth, wait time, rejections).
docs/metrics.md lists every series; a test checks it against /metrics.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.spec_metrics import SpecCollector
from protocol import tandem_pb2

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class Metrics:
    """All gateway metrics, registered in `self.registry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = LoopHistogram("tandem_time_to_first_token_seconds",
                                  "Request arrival to first token sent", _LATENCY_BUCKETS)
        self.itl = LoopHistogram("tandem_inter_token_latency_seconds",
                                 "Time between output tokens", _ITL_BUCKETS)
        self.e2e = LoopHistogram("tandem_e2e_request_latency_seconds",
                                 "Request arrival to last byte", _LATENCY_BUCKETS)
        for histogram in (self.ttft, self.itl, self.e2e):
            r.register(histogram)
        # Changed once or more per request: loop-only collectors, no lock per change.
        self.requests = LoopCounter("tandem_requests", "Finished requests by outcome",
                                    ("outcome",))
        for outcome in ("success", "client_error", "rejected", "server_error", "aborted"):
            self.requests.labels(outcome)
        self.prompt_tokens = LoopCounter("tandem_prompt_tokens",
                                         "Prompt tokens of served requests")
        self.generation_tokens = LoopCounter("tandem_generation_tokens", "Generated tokens")
        self.cached_tokens = LoopCounter("tandem_cached_tokens",
                                         "Prompt tokens served from a prefix cache")
        self.kv_transfer_bytes = LoopCounter("tandem_kv_transfer_bytes",
                                             "KV bytes moved for PD requests")
        self.kv_transfer_pages = LoopCounter("tandem_kv_transfer_pages",
                                             "KV pages moved for PD requests")
        self.kv_transfer_duration = LoopHistogram("tandem_kv_transfer_duration_seconds",
                                                  "KV transfer time per request",
                                                  _LATENCY_BUCKETS)
        for collector in (self.requests, self.prompt_tokens, self.generation_tokens,
                          self.cached_tokens, self.kv_transfer_bytes, self.kv_transfer_pages,
                          self.kv_transfer_duration):
            r.register(collector)
        self.retries = Counter(
            "tandem_retries", "Requests retried on a new worker before the client saw a token",
            registry=r
        )
        self.kv_transfer_failures = Counter(
            "tandem_kv_transfer_failures",
            "PD requests whose decode leg failed before its first token",
            registry=r,
        )
        self.bootstrap_failures = Counter(
            "tandem_bootstrap_failures", "PD legs that failed with a bootstrap error", registry=r)
        labels = ["pool", "worker"]
        self.worker_running = Gauge(
            "tandem_worker_running", "Running requests (GetLoad)", labels, registry=r
        )
        self.worker_waiting = Gauge(
            "tandem_worker_waiting", "Queued requests (GetLoad)", labels, registry=r
        )
        self.worker_kv_used = Gauge(
            "tandem_worker_kv_used_pages", "KV pages in use (GetLoad)", labels, registry=r
        )
        self.worker_kv_total = Gauge(
            "tandem_worker_kv_total_pages", "KV pages in the pool (GetLoad)", labels, registry=r
        )
        self.worker_healthy = Gauge(
            "tandem_worker_healthy", "1 when the worker takes requests", labels, registry=r
        )
        self.pool_running = Gauge(
            "tandem_pool_running", "Running requests per pool", ["pool"], registry=r
        )
        self.pool_waiting = Gauge(
            "tandem_pool_waiting", "Queued requests per pool", ["pool"], registry=r
        )
        # Every series below has a sample from the start (docs/metrics.md is checked against
        # /metrics): label values are created at zero, per worker at its first GetLoad.
        self.worker_faults = Counter(
            "tandem_worker_faults", "Failed attempts charged to a worker (a retry avoids it)",
            labels, registry=r)
        self.unasked_aborts = Counter(
            "tandem_unasked_aborts", "Legs that ended with finish_reason abort although the "
            "gateway did not ask (retried before the first token, else a 5xx)", ["leg"],
            registry=r)
        self.stream_stalls = Counter(
            "tandem_stream_stalls", "Streams ended because no token came for "
            "gateway.stream_stall_timeout_s", ["pool"], registry=r)
        for leg in ("prefill", "decode", "mono"):
            self.unasked_aborts.labels(leg)
        for pool in ("decode", "workers"):
            self.stream_stalls.labels(pool)
        self.queue_depth = Gauge("tandem_queue_depth", "Requests the gateway holds until a "
                                 "worker of the pool has a free seat", ["pool"], registry=r)
        # Observed once a request (a wait of 0 when a seat was free): a loop-only histogram.
        self.queue_wait = LoopHistogram("tandem_queue_wait_seconds", "Time a request waited "
                                        "at the gateway for a seat", _LATENCY_BUCKETS, ["pool"])
        r.register(self.queue_wait)
        self.queue_rejected = Counter("tandem_queue_rejected", "Requests refused by the "
                                      "gateway's queue (full: 429; timeout: 503)",
                                      ["pool", "reason"], registry=r)

        self.spec = SpecCollector()
        r.register(self.spec)
        self.totals = WorkerTotals()
        r.register(self.totals)

    def request_ended(self, outcome: str, t0: float, prompt_tokens: int, completion_tokens: int,
                      cached_tokens: int) -> None:
        """One request's end, counted once (an n > 1 request: its choices' tokens summed);
        t0 is its perf_counter start."""
        self.requests.labels(outcome).inc()
        self.e2e.observe(time.perf_counter() - t0)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)

    def observe_load(self, pool: str, url: str, load: tandem_pb2.Load, healthy: bool) -> None:
        self.spec.observe(pool, url, load)
        self.totals.observe(pool, url, load)
        self.worker_running.labels(pool, url).set(load.running)
        self.worker_waiting.labels(pool, url).set(load.waiting)
        self.worker_kv_used.labels(pool, url).set(load.kv_used_pages)
        self.worker_kv_total.labels(pool, url).set(load.kv_total_pages)
        self.worker_healthy.labels(pool, url).set(1 if healthy else 0)
        self.worker_faults.labels(pool, url)  # at zero until a fault is charged to it

    def remove_worker(self, pool: str, url: str) -> None:
        """A worker left the pool: its series leave /metrics with it (gauges, totals, spec)."""
        for gauge in (self.worker_running, self.worker_waiting, self.worker_kv_used,
                      self.worker_kv_total, self.worker_healthy, self.worker_faults):
            with contextlib.suppress(KeyError):  # never observed
                gauge.remove(pool, url)
        self.totals.forget(pool, url)
        self.spec.forget(pool, url)

    def observe_transfer(self, stats: tandem_pb2.TransferStats) -> None:
        self.kv_transfer_bytes.inc(stats.bytes)
        self.kv_transfer_pages.inc(stats.pages)
        self.kv_transfer_duration.observe(stats.duration_ms / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram(Collector):
    """A latency histogram observed only on the gateway's event loop (one thread): a bisect
    and two additions, ~0.3 us, where prometheus_client's Histogram takes a lock for the sum
    and for the bucket (~1.5 us here; the inter-token one is observed per streamed token).
    Exported as the same Prometheus histogram: `_bucket` (cumulative, `le`), `_sum`,
    `_count`. With `labelnames`, `labels(*values)` gives each series (made at its first call,
    as prometheus_client's are) and the histogram itself is not observed."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = ()) -> None:
        self._name = name
        self._doc = documentation
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], LoopHistogram] = {}

    def labels(self, *values: str) -> LoopHistogram:
        series = self._series.get(values)
        if series is None:
            assert len(values) == len(self._labelnames), (self._name, values)
            series = self._series[values] = LoopHistogram(self._name, self._doc,
                                                          self._bounds[:-1])
        return series

    def observe(self, value: float, count: int = 1) -> None:
        """`count` samples of `value` (one addition each, whatever the count)."""
        self._counts[bisect.bisect_left(self._bounds, value)] += count  # first bound >= value
        self._sum += value * count

    def _buckets(self) -> list[tuple[str, float]]:
        cumulative = itertools.accumulate(self._counts)
        return [(floatToGoString(b), c) for b, c in zip(self._bounds, cumulative, strict=True)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        if not self._labelnames:
            yield HistogramMetricFamily(self._name, self._doc, sum_value=self._sum,
                                        buckets=self._buckets())
            return
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, series in self._series.items():
            family.add_metric(list(values), series._buckets(), series._sum)
        yield family


class LoopCounter(Collector):
    """A counter changed only on the gateway's event loop: one addition, where
    prometheus_client's Counter takes a lock for the labels and another for the value (~1 us
    here, four times a request). Exported as the same Prometheus counter (`_total` and
    `_created`, one series per label value, each from its first `labels` call)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], LoopCount] = {}
        if not labelnames:
            self._series[()] = LoopCount()

    def labels(self, *values: str) -> LoopCount:
        count = self._series.get(values)
        if count is None:
            assert len(values) == len(self._labelnames), (self._name, values)
            count = self._series[values] = LoopCount()
        return count

    def inc(self, amount: float = 1.0) -> None:
        """The counter without labels."""
        self._series[()].inc(amount)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labelnames)
        for values, count in self._series.items():
            family.add_metric(values, count.value, created=count.created)
        yield family


class LoopCount:
    """One series of a LoopCounter."""

    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"a counter only goes up; got {amount}")
        self.value += amount


class TokenClock:
    """Inter-token latency of one request's output, one sample per token after the first:
    every later output gives the gap since the previous one divided over its tokens, and the
    tokens that came with the first (`first_tokens` - 1: messages the gateway read together,
    or a worker's first message holding more than one token) reached the client with it, a gap
    of 0. So the count is the output's tokens - 1 and the sum its time after the first token
    (vLLM's TPOT)."""

    __slots__ = ("_itl", "_last")

    def __init__(self, itl: LoopHistogram, first_tokens: int) -> None:
        self._itl = itl
        self._last = time.perf_counter()  # when the previous output arrived
        if first_tokens > 1:
            itl.observe(0.0, first_tokens - 1)

    def arrived(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if num_tokens:
            self._itl.observe((now - self._last) / num_tokens, num_tokens)
        self._last = now


class WorkerTotals(Collector):
    """Running totals each worker keeps since it started (GetLoad), exported as counters: the
    latest snapshot per worker, so a request counts however it ended; a restarted worker
    starts again from 0, which Prometheus' rate() reads as a counter reset."""

    _COUNTERS = {  # name: (help, Load field)
        "tandem_worker_transfer_bytes": ("KV bytes the worker sent (prefill) or received "
                                         "(decode) since it started", "transfer_bytes"),
        "tandem_worker_transfer_pages": ("KV pages the worker sent or received since it "
                                         "started", "transfer_pages"),
        "tandem_worker_prompt_tokens_computed": ("Prompt tokens the worker ran through the "
                                                 "model since it started (0 on decode)",
                                                 "prompt_tokens_computed"),
    }

    def __init__(self) -> None:
        self._loads: dict[tuple[str, str], tandem_pb2.Load] = {}

    def observe(self, pool: str, url: str, load: tandem_pb2.Load) -> None:
        self._loads[(pool, url)] = load

    def forget(self, pool: str, url: str) -> None:
        self._loads.pop((pool, url), None)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (doc, field) in self._COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["pool", "worker"])
            for (pool, url), load in self._loads.items():
                family.add_metric([pool, url], float(getattr(load, field)))
            yield family
