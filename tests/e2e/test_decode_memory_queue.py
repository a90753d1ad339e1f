"""A decode worker whose memory runs out before its seats: rooms queue, none fails.

The gateway holds requests only while every decode seat is taken, so with long answers a
decode worker can have a free seat and no free pages: the request waits on decode with nothing
registered at prefill. Decode now holds the room there (HoldRoom, transfer/holds.py) while it
waits, so prefill's bootstrapping deadline (1 s here) no longer fails a room whose decode
worker is alive and only full. Before: such requests got 502 "deadline in bootstrapping passed
(waiting on decode)", and the gateway marked the busy decode worker suspect (503s after it).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, Cluster, running_cluster

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
BOOTSTRAP_S = 1.0
REQUESTS, PROMPT, MAX_TOKENS = 8, "k=3;" * 40, 300  # 160-token prompts, answers of 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # 30 pages of 16 tokens: one answer (460 tokens) at a time, while 8 seats stay free
    with running_cluster("configs/tiny-1p1d.yaml", f"transfer.bootstrap_timeout_s={BOOTSTRAP_S}",
                         "roles.decode.cache.max_total_tokens=480",
                         tmp=tmp_path_factory.mktemp("full-decode"), model=MODEL) as c:
        yield c


def test_rooms_wait_for_decode_memory(full_decode: Cluster) -> None:
    c = full_decode

    async def run() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=c.url, timeout=120) as client:
            body = {"model": MODEL.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "temperature": 0}

            async def one() -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                return r, time.monotonic() - t0

            return list(await asyncio.gather(*(one() for _ in range(REQUESTS))))

    answers = asyncio.run(run())
    errors = [(r.status_code, r.text[:200]) for r, _ in answers if r.status_code != 200]
    assert not errors, errors
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r, _ in answers)
    # they queued on decode for longer than prefill's deadline (several answers, one at a time)
    assert max(s for _, s in answers) > 2 * BOOTSTRAP_S, [s for _, s in answers]
    c.wait_drained(timeout_s=30)
