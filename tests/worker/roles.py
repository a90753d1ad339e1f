"""PD roles over real transfer managers (the fake backend, a real gRPC bootstrap service) for
tests of the roles with real schedulers and no model behind them."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import torch

from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import layout
from tests.worker.factories import make_request
from transfer.backend import TransferFaults
from transfer.config import TransferConfig
from transfer.manager import KVTransferManager
from worker.decode import DecodeRole
from worker.prefill import PrefillRole
from worker.request import Request


def _manager(role: str) -> tuple[KVTransferManager, torch.Tensor]:
    lay = layout(num_pages=64)
    pool = torch.zeros(lay.pool_bytes, dtype=torch.uint8)
    mgr = KVTransferManager(TransferConfig(), lay, role=role, kv_ptr=pool.data_ptr(),
                            kv_nbytes=pool.numel(), host="127.0.0.1", model_fingerprint="fp",
                            model_name="tiny", faults=TransferFaults(), backend=FakeBackend())
    return mgr, pool


@contextmanager
def prefill_role(layerwise_interval: int = 0) -> Iterator[tuple[PrefillRole, str]]:
    """A prefill role (page size 4) and its bootstrap address."""
    mgr, pool = _manager("prefill")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    mgr.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    role = PrefillRole(mgr, server, page_size=4, layerwise_interval=layerwise_interval)
    try:
        yield role, f"127.0.0.1:{port}"
    finally:
        role.close()
        del pool


@contextmanager
def decode_role() -> Iterator[DecodeRole]:
    mgr, pool = _manager("decode")
    role = DecodeRole(mgr, page_size=4)
    try:
        yield role
    finally:
        role.close()
        del pool


def with_room(room: int, bootstrap_addr: str, num_prompt_tokens: int = 10) -> Request:
    """A request of its own prompt (no prefix shared with another room's) bound to `room`."""
    req = make_request(max_tokens=3, prompt=[room * 100 + i for i in range(num_prompt_tokens)])
    req.room, req.bootstrap_addr = room, bootstrap_addr
    return req
