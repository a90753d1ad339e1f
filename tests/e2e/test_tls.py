"""gRPC over TLS: with `tls.cert_file/key_file/ca_file`, every gRPC link of a 1P1D cluster
(gateway → workers, decode → prefill bootstrap, launcher health checks) is encrypted, and a
plaintext client is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest

from orchestrator.launch.background import EMBEDDED_MODEL, running_cluster
from protocol import tandem_pb2, tandem_pb2_grpc
from protocol.tls import TLSConfig

MODEL = Path(os.environ.get("TANDEM_E2E_MODEL", EMBEDDED_MODEL))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]


def self_signed(tmp: Path) -> TLSConfig:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=tandem-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return TLSConfig(cert_file=str(cert), key_file=str(key), ca_file=str(cert))


def test_1p1d_over_tls(tmp_path: Path) -> None:
    tls = self_signed(tmp_path)
    with running_cluster("configs/tiny-1p1d.yaml", tmp=tmp_path, model=MODEL, tls=tls) as c:
        r = httpx.post(
            f"{c.url}/v1/completions",
            json={
                "model": MODEL.name,
                "prompt": "a=12;b=34;\na,b?",
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        loads = c.wait_drained()
        assert loads["decode-0"].transfer_pages > 0  # the room's bootstrap ran over TLS too
        with grpc.insecure_channel(c.workers["prefill-0"]) as plain, pytest.raises(grpc.RpcError):
            tandem_pb2_grpc.WorkerStub(plain).GetInfo(tandem_pb2.GetInfoRequest(), timeout=3)
