"""POST /workers: a malformed worker address is a 400 naming it, before anything is dialed.

An address gRPC cannot take as host:port (a space or newline in the host, an unbracketed
IPv6 address, a gRPC scheme, a query, non-ASCII digits in the port) was dialed as it was and
answered 502 `worker_unreachable` with gRPC's resolver text; one with `?` dialed port 443.
"""

from __future__ import annotations

import pytest

from tests.gateway.gw_doubles import running_app, workers
from tests.gateway.test_gateway_admin import ADMIN, Member, config, listed, until

pytestmark = pytest.mark.anyio

MALFORMED = [
    ("no such host:5", "host"),  # a space: gRPC's resolver says "Misformatted domain name"
    (" 127.0.0.1:5", "host"),
    ("127.0.0.1\n:5", "host"),
    ("127.0.0.1?x:5", "host"),  # gRPC dialed 127.0.0.1:443
    ("::1:5", "host"),  # IPv6 goes in brackets
    ("[127.0.0.1]:5", "host"),  # brackets hold an IPv6 address only
    ("[::1:5", "host"),
    ("ipv4:127.0.0.1:5", "host"),  # a gRPC target scheme, not an address
    ("-bad.example:5", "host"),
    ("127.0.0.1:\u0664\u0667", "port"),  # Arabic-Indic digits: str.isdigit() says yes
    ("127.0.0.1:0", "port"),
    ("127.0.0.1:65536", "port"),
]


@pytest.mark.parametrize(("url", "part"), MALFORMED)
async def test_a_malformed_address_is_a_400_naming_it(tok_dir, url: str, part: str) -> None:
    a = Member()
    async with workers(a), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        r = await c.post("/workers", json={"url": url, "role": "both"}, headers=ADMIN)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "invalid_value", "url", "invalid_request_error"
        ), r.text
        assert "\n" not in err["message"] and repr(url) in err["message"], err["message"]
        assert f"the {part} " in err["message"], err["message"]
        assert list(await listed(c)) == [a.url]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "decode-0.tandem.svc",
                                  "decode-0.tandem.svc.cluster.local.", "worker_1"])
async def test_well_formed_addresses_are_dialed(tok_dir, host: str) -> None:
    a = Member()
    async with workers(a), running_app(config(tok_dir, workers=(a.url,))) as c:
        await until(c, a.url, "serving")
        # Nothing listens on port 1: past the address check, the dial answers 502.
        r = await c.post("/workers", json={"url": f"{host}:1", "role": "both"}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["code"]) == (502, "worker_unreachable"), r.text
