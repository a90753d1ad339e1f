"""What an operator reads: failed requests in the log, /metrics while idle, probes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys

import grpc
import httpx
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.gw_doubles import Script, ScriptedWorker, fast_config, running_app, workers
from tests.gateway.test_gateway_server import ROOT

pytestmark = pytest.mark.anyio


def script_for(tok_dir, text: str, **kw) -> Script:
    return Script(tokens=Tokenizer.from_dir(tok_dir).encode(text, add_special_tokens=False), **kw)


@pytest.mark.parametrize(("n", "stream"), [(1, False), (2, False), (2, True)])
async def test_answer_failing_past_its_first_token_is_logged(tok_dir, caplog, n, stream):
    """An answer whose worker fails after two tokens (and again on the retry) is a 5xx the
    operator must see in the log once, at WARNING, with the request's id; a non-streamed one,
    and any with n > 1, were answered with no log line at all."""
    w = ScriptedWorker(script=script_for(
        tok_dir, "one two three", fail_code=grpc.StatusCode.INTERNAL, fail_after=2))
    async with workers(w), running_app(fast_config(tok_dir, workers=(w.url,))) as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "n": n, "stream": stream},
                         headers={"x-request-id": "req-cut-7"})
        if stream:
            assert r.status_code == 200 and '"code": "internal"' in r.text, r.text
        else:
            assert r.status_code == 502, r.text
        failed = [rec for rec in caplog.records
                  if rec.levelname == "WARNING" and "req-cut-7" in rec.getMessage()]
        assert len(failed) == 1, caplog.text
        assert "internal" in failed[0].getMessage().lower(), failed[0].getMessage()


async def test_the_gateway_log_has_one_line_format(tok_dir, tmp_path):
    """lb.log mixed two formats: the gateway's lines carry a time, uvicorn's own (start-up,
    shutdown, errors it catches) came as `INFO:     Started server process [N]`, with no time
    to place them among the others."""
    w = ScriptedWorker(script=script_for(tok_dir, "hi"))
    port = 30990  # this suite's own
    log = tmp_path / "lb.log"
    async with workers(w):
        code = ("from gateway.config import GatewayConfig; from gateway.server import "
                f"run_gateway; run_gateway(GatewayConfig(port={port}, workers=({w.url!r},), "
                f"model_path={str(tok_dir)!r}, health_interval_s=0.05, log_level='info'))")
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)
            try:
                async with httpx.AsyncClient() as client:
                    for _ in range(300):  # readiness: /health says 200 (bounded: 15 s)
                        with contextlib.suppress(httpx.TransportError):
                            if (await client.get(f"http://127.0.0.1:{port}/health")
                                    ).status_code == 200:
                                break
                        assert proc.poll() is None, log.read_text()
                        await asyncio.sleep(0.05)
            finally:
                proc.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(proc.wait, 10) == 0
    lines = log.read_text().splitlines()
    assert any("Uvicorn running on" in line for line in lines), lines
    stamped = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")
    assert all(stamped.match(line) for line in lines), lines
