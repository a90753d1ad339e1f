"""`tandem worker --join URL`: a worker that adds itself to a running gateway, and leaves.

Lifecycle (a thread beside the worker's own serving loop):
  1. Wait until the worker's own gRPC health says SERVING (bounded by the ready deadline).
  2. POST {url, role} to <gateway>/workers with the admin key; the gateway checks the
     worker's identity (cluster id, role, model) before it routes anything to it (201; 200
     when its url is listed already: this worker restarted on it, or a retried POST).
     Connection errors are retried until the deadline (the gateway may still be starting); a
     refusal (401/403/409/4xx) is final: the worker logs the gateway's one-line reason and
     stops.
  3. While it serves, it POSTs again every `renew_s` (5 s): the gateway answers 200 while it
     lists the worker, and adds it again (201) once it forgot it: a gateway that restarted
     routes to every joined worker again within `renew_s` of answering. Connection errors
     (the gateway is down) and refusals are logged when they change and retried; the worker
     keeps serving meanwhile.
  4. When the worker drains (SIGTERM, or the gateway's DELETE), `leave()` stops the renewals
     (after the one in flight) and sends DELETE /workers/<url>, so the gateway stops routing
     to it at once and drops it once it has exited.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from orchestrator.launch.readiness import HealthWatch
from protocol.tls import TLSConfig

log = logging.getLogger("tandem.join")
_RETRY_S = 0.5


class JoinRefused(RuntimeError):
    """The gateway refused the worker (or never answered); the message says why."""


@dataclass(frozen=True)
class Join:
    gateway_url: str  # http://host:port of the running gateway
    worker_url: str  # host:port the gateway dials
    role: str
    admin_key: str
    timeout_s: float  # from the worker's start until it must have joined
    renew_s: float = 5.0  # how often a joined worker POSTs again (a restarted gateway)
    joined: threading.Event = field(default_factory=threading.Event, compare=False)
    leaving: threading.Event = field(default_factory=threading.Event, compare=False)
    # Held while a renewal's POST is in flight: `leave` waits for it before its DELETE.
    _posting: threading.Lock = field(default_factory=threading.Lock, compare=False)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def _root(self) -> str:
        """The gateway's root URL: an OpenAI client's base URL (http://host:port/v1) names the
        same gateway, whose admin routes are at the root."""
        root = self.gateway_url.rstrip("/")
        return root.removesuffix("/v1").rstrip("/")

    def _post(self) -> httpx.Response:
        """POST {url, role} to the gateway's /workers (the join, and each renewal)."""
        return httpx.post(f"{self._root()}/workers",
                          json={"url": self.worker_url, "role": self.role},
                          headers=self._headers(), timeout=10.0)

    def register(self, deadline: float) -> None:
        """POST /workers until the gateway answers; JoinRefused on a refusal or the deadline."""
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                resp = self._post()
            except httpx.HTTPError as exc:
                if last == "no answer":  # the first miss: say what it waits for, once
                    log.warning("joining %s: no answer yet (%s); retrying for %.0f s more",
                                self.gateway_url, type(exc).__name__,
                                deadline - time.monotonic())
                last = f"{type(exc).__name__}: {exc}"
                time.sleep(_RETRY_S)
                continue
            if resp.status_code in (200, 201):  # 200: listed already (restarted on its url)
                log.info("joined %s as %s %s", self.gateway_url, self.role, self.worker_url)
                self.joined.set()
                return
            hint = ""
            if _error(resp, "code") == "identity_mismatch":  # e.g. --config configs/X.yaml
                hint = ("; a joining worker takes the run's config: --config "
                        "logs/<gateway port>/cluster.yaml")
            raise JoinRefused(
                f"{self.gateway_url} refused {self.worker_url}: HTTP "
                f"{resp.status_code}: {_message(resp)}{hint}"
            )
        raise JoinRefused(f"{self.gateway_url} did not answer POST /workers in time ({last})")

    def renew(self) -> None:
        """POST /workers every `renew_s` until `leave`: 200 while the gateway lists this
        worker, 201 when it had forgotten it (it restarted). Logs each change of answer."""
        last = "joined"
        while not self.leaving.wait(self.renew_s):
            with self._posting:
                if self.leaving.is_set():
                    return
                try:
                    resp = self._post()
                    now = {200: "joined", 201: "joined again"}.get(
                        resp.status_code, f"HTTP {resp.status_code}: {_message(resp)}")
                except httpx.HTTPError as exc:
                    now = f"no answer ({type(exc).__name__})"
            if now == "joined again":
                log.warning("%s had forgotten this worker (restarted?): joined again as %s %s",
                            self.gateway_url, self.role, self.worker_url)
                now = "joined"
            elif now != last and now != "joined":
                log.warning("renewing the join at %s: %s; retrying every %g s",
                            self.gateway_url, now, self.renew_s)
            last = now

    def leave(self) -> None:
        """Stop the renewals, then DELETE /workers/<url> (best effort: the gateway also sees
        the worker drain); nothing when it never joined (refused, or stopped before it was
        SERVING)."""
        self.leaving.set()
        with self._posting:  # a renewal's POST in flight lands before the DELETE
            pass
        if not self.joined.is_set():
            return
        url = f"{self._root()}/workers/{self.worker_url}"
        try:
            resp = httpx.delete(url, headers=self._headers(), timeout=5.0)
        except httpx.HTTPError as exc:
            log.warning("leaving %s: %s", self.gateway_url, exc)
            return
        if resp.status_code not in (202, 404):
            log.warning(
                "leaving %s: HTTP %d: %s", self.gateway_url, resp.status_code, _message(resp)
            )

    def start(self, tls: TLSConfig, on_refused: Callable[[str], None]) -> threading.Thread:
        """Register in the background once the worker is SERVING; `on_refused(reason)` else."""

        def run() -> None:
            deadline = time.monotonic() + self.timeout_s
            wake = threading.Event()
            watch = HealthWatch(self.worker_url, wake, tls)
            watch.start(self.timeout_s)
            try:
                if not watch.ready.wait(self.timeout_s):
                    on_refused(f"the worker was not SERVING within {self.timeout_s:g} s")
                    return
            finally:
                watch.close()
            if self.leaving.is_set():  # it drains before it ever joined: nothing to join
                return
            try:
                self.register(deadline)
            except JoinRefused as exc:
                on_refused(str(exc))
                return
            self.renew()

        thread = threading.Thread(target=run, name="join", daemon=True)
        thread.start()
        return thread


def _error(resp: httpx.Response, field: str) -> str:
    """A field of the gateway's OpenAI-shaped error body ("" when the body has none)."""
    try:
        return str(resp.json()["error"][field])
    except (ValueError, KeyError, TypeError):
        return ""


def _message(resp: httpx.Response) -> str:
    """The gateway's one-line reason; a body without one (an HTML error page) is not the
    gateway's answer: said so, on one line."""
    if said := _error(resp, "message"):
        return said
    kind = resp.headers.get("content-type", "no content type")
    return f"not a Tandem gateway's answer ({kind}): {' '.join(resp.text.split())[:200]}"
