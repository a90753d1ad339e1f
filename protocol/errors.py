"""The worker's error class on the wire, shared by worker and gateway.

A failed request carries why it failed beyond its gRPC status: in a Generate call's trailing
metadata under ERROR_CODE_KEY, on the Session stream in RequestEnd.error_code. The gateway reads
it to put the blame on the right worker (docs/reliability.md).
"""

ERROR_CODE_KEY = "tandem-error-code"
PEER_TIMEOUT = "peer_timeout"  # the room's other side stopped answering in time
# The gateway's own bound on a request's whole time (gateway.request_timeout_s) ran out: the
# gateway ends the leg itself; no worker failed, so none is blamed and nothing is retried.
REQUEST_TIMEOUT = "request_timeout"
