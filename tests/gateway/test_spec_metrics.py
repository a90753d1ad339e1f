"""tandem_spec_* as the gateway exports a drafting worker's GetLoad totals (gateway/
spec_metrics.py): at zero from the worker's start with every bucket, and no acceptance rate
until a draft was scored (0 of 0 is not 0%)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.spec_metrics import SpecCollector
from protocol import tandem_pb2


def _exported(spec: tandem_pb2.SpecLoad) -> list[str]:
    collector = SpecCollector()
    collector.observe("decode", "w:1", tandem_pb2.Load(spec=spec))
    registry = CollectorRegistry()
    registry.register(collector)
    return [ln for ln in generate_latest(registry).decode().splitlines()
            if ln.startswith("tandem_spec_")]


def test_a_drafting_worker_before_its_first_draft() -> None:
    lines = _exported(tandem_pb2.SpecLoad(accepted_hist=[0, 0, 0, 0]))  # k = 3
    buckets = [ln for ln in lines if ln.startswith("tandem_spec_accepted_length_bucket")]
    assert len(buckets) == 5 and all(ln.endswith(" 0.0") for ln in buckets)  # le 1..4, +Inf
    assert any(ln.startswith("tandem_spec_draft_tokens_total{") for ln in lines)
    assert not any(ln.startswith("tandem_spec_acceptance_rate{") for ln in lines)


def test_the_rate_once_drafts_were_scored() -> None:
    lines = _exported(tandem_pb2.SpecLoad(draft_tokens=8, accepted_tokens=6, request_steps=3,
                                          accepted_hist=[0, 1, 1, 1]))
    (rate,) = [ln for ln in lines if ln.startswith("tandem_spec_acceptance_rate{")]
    assert rate.endswith(" 0.75")
