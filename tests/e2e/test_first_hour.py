"""A user's first hour against real clusters: what /metrics says after a request that ends on
a stop string (against docs/metrics.md), and a checkpoint with no tokenizer served in token-id
mode (as `save_pretrained` of a model alone writes it)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.config import REPO_ROOT
from orchestrator.devices import cuda_status
from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster
from orchestrator.tasks import arith

pytestmark = pytest.mark.slow
DOC = REPO_ROOT / "docs" / "metrics.md"


def documented() -> dict[str, str]:
    """name -> type from docs/metrics.md's table."""
    rows = re.findall(r"^\| `(tandem_\w+)` \| (counter|gauge|histogram) \|", DOC.read_text(),
                      re.MULTILINE)
    assert len(rows) > 20
    return dict(rows)


def served(url: str) -> dict[str, tuple[str, int]]:
    """family name -> (type, number of samples) from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    # prometheus_client writes each counter's and histogram's start time as its own gauge
    # family, NAME_created (the table documents it once, above it)
    return {f.name: (f.type, len(f.samples)) for f in text_string_to_metric_families(text)
            if f.name.startswith("tandem_") and not f.name.endswith("_created")}


def itl_samples_of_a_request(url: str, stream: bool) -> tuple[float, int]:
    """(tandem_inter_token_latency_seconds' new samples, completion tokens - 1) of one request
    of 12 tokens."""
    def count() -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return next(s.value for f in text_string_to_metric_families(text)
                    if f.name == "tandem_inter_token_latency_seconds"
                    for s in f.samples if s.name.endswith("_count"))

    body = {"model": EMBEDDED_MODEL.name, "prompt": arith.make_problems(1, seed=8)[0].prompt,
            "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    before = count()
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            usage = [json.loads(line[6:])["usage"] for line in r.iter_lines()
                     if line.startswith("data: {")][-1]
    else:
        usage = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
    return count() - before, usage["completion_tokens"] - 1


def test_every_documented_metric_after_a_pd_request_that_ends_on_a_stop_string(
        tmp_path: Path) -> None:
    problem = arith.make_problems(1, seed=7)[0]
    with running_cluster("configs/tiny-1p1d.yaml", "speculative.method=ngram",
                         tmp=tmp_path) as c:
        body = {"model": EMBEDDED_MODEL.name, "prompt": problem.prompt, "max_tokens": 40,
                "temperature": 0, "ignore_eos": True, "stop": [";"], "stream": True}
        with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        answer = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        # cut at the stop string while the worker (ignore_eos, 40 tokens) would go on
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and ";" not in answer
        deadline = time.monotonic() + 10
        want = documented()
        while True:  # per-worker series follow GetLoad (every 0.5 s)
            have = served(c.url)
            empty = [n for n in want if n in have and have[n][1] == 0]
            if (not empty and "tandem_kv_transfer_duration_seconds" in have) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        itl_samples = [itl_samples_of_a_request(c.url, stream) for stream in (False, True)]
        c.wait_drained()
    # one sample per output token after the first, the tokens that came with the first one
    # included (under PD decode's first message carries the first token and its first step's)
    assert itl_samples == [(11.0, 11), (11.0, 11)], itl_samples
    missing = sorted(set(want) - set(have))
    undocumented = sorted(set(have) - set(want))
    assert not missing and not undocumented, (missing, undocumented)
    assert {n: have[n][0] for n in want} == want  # the documented types
    assert not empty, f"documented metrics without a sample: {empty}"


def test_a_checkpoint_without_a_tokenizer_serves_token_ids_1p1d(tmp_path: Path) -> None:
    from tests.worker.conftest import build_tiny_checkpoint

    ckpt = tmp_path / "random-qwen3"
    hf = build_tiny_checkpoint(ckpt, "qwen3", vocab_size=128, max_position_embeddings=256)
    assert not list(ckpt.glob("tokenizer*"))
    prompt = [5, 17, 33, 2, 90, 41, 8, 64, 100, 3, 77, 12, 6, 54, 19, 21, 99, 4]
    with running_cluster("configs/tiny-1p1d.yaml", "model.dtype=float32", tmp=tmp_path,
                         model=ckpt) as c:
        r = httpx.post(f"{c.url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False)[0, len(prompt):].tolist()
        assert choice["token_ids"] == want and choice["text"] == ""
        bad = httpx.post(f"{c.url}/v1/completions", timeout=10, json={"prompt": "hello"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "no_tokenizer"
        loads = c.wait_drained()
        assert loads["decode-0"].transfer_pages > 0 and loads["decode-0"].kv_used_pages == 0
    out = (tmp_path / "serve.out").read_text()
    assert "has no tokenizer files: the gateway takes token-id prompts" in out


def test_ready_and_stopped_lines_and_a_clean_multi_rank_shutdown(tmp_path: Path) -> None:
    """configs/tiny-1p1d-hetero-tp.yaml (prefill TP 2): the ready line names the model, each
    worker's ranks and device, the transfer backend and the logs; SIGTERM to the launcher (as
    Ctrl-C) stops it all and says so, with no traceback in any log (gloo's "Connection closed
    by peer" came from the second rank dying on the group's signal before rank 0's STOP)."""
    with running_cluster("configs/tiny-1p1d-hetero-tp.yaml", tmp=tmp_path) as c:
        r = httpx.post(f"{c.url}/v1/completions", timeout=60,
                       json={"prompt": "a=1;b=2;\na?", "max_tokens": 4})
        assert r.status_code == 200, r.text
        c.wait_drained()
        log_dir = c.log_dir
        cid = yaml.safe_load((log_dir / "cluster.yaml").read_text())["launcher"]["cluster_id"]
    out = (tmp_path / "serve.out").read_text()
    ready = next(line for line in out.splitlines() if line.startswith("ready: "))
    gpu = cuda_status().available  # device auto: the GPUs in order where there are some
    devices = ("cuda:0-1", "cuda:2") if gpu else ("cpu", "cpu")
    assert ready.endswith(f"(model tandem-arith; prefill-0 [tp 2, {devices[0]}], decode-0 "
                          f"[{devices[1]}]; mooncake tcp; cluster {cid}; logs {log_dir.resolve()})")
    assert f"stopped: lb (0), prefill-0 (0), decode-0 (0); logs in {log_dir.resolve()}" in out
    for log in log_dir.glob("*.log"):
        text = log.read_text()
        assert "Traceback" not in text and "Connection closed by peer" not in text, log.name
        assert "Local segment descriptor not found" not in text, log.name
