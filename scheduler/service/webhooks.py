"""The webhook sender: takes due deliveries from the outbox (`webhook_deliveries`, written with their events by
common/events.py), POSTs them signed, and records each attempt.

The pure parts come first: the signature (`sign`, `verify`: what a receiver checks) and the retry schedule
(`next_delay`). `WebhookSender` is the thin loop around them; the scheduler daemon runs it on its own thread, so a
slow receiver never holds up a scheduling round.

Nothing is lost when the sender dies: a delivery is *claimed* by moving its `next_attempt_at` a claim period ahead
(committed before the POST), and marked delivered only after a 2xx answer was recorded. A sender that dies between
the two leaves the delivery pending, and it is sent again once the claim runs out: at least once, never zero times;
receivers drop repeats by `X-Loraplane-Delivery`. The claim is taken under a row lock with SKIP LOCKED (Postgres),
so two senders never take the same delivery at once; SQLite has one process, and one sender in it.

Each attempt resolves the URL's host again and checks every address (common/egress.py): a name that was public at
registration and points inward now (DNS rebinding, or a record changed since) is refused before any connection,
and the connection goes to the address that was checked, not to a second resolution (`pinned_post`). The tenant's
delivery log gets a generic reason (`last_error`: "delivery failed: could not connect", "... timeout", "HTTP 500");
the details (addresses, the socket's error) go to the operator's log only, so the log is no port scanner.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select

from common.db import session_scope
from common.egress import NOT_ALLOWED, Egress, EgressRefused, IPAddress, Target
from common.secret_box import get_secret_box
from common.settings import get_settings
from common.tables import WebhookDelivery, WebhookEndpoint, utcnow
from common.webhooks import DELIVERY_DELIVERED, DELIVERY_FAILED, DELIVERY_PENDING

log = logging.getLogger(__name__)

# Seconds to wait after the 1st, 2nd, ... failed attempt; after the last one the delivery has failed. Ten attempts
# over about a day ride out a receiver's deploy or an outage of some hours.
BACKOFF_S: tuple[float, ...] = (10, 30, 120, 600, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600)
TIMEOUT_S = 10.0  # one attempt's limit: connect, send and answer
# A claimed delivery is taken again after this long if its sender never recorded the attempt (it died). Well over
# TIMEOUT_S, so a live sender always records before anyone else may take it.
CLAIM_S = 60.0
IDLE_POLL_S = 1.0  # how often an idle sender looks for due deliveries
# What a tenant's delivery log says about an attempt that got no HTTP answer: the kind of failure and nothing that
# tells a closed port from an open one that is no HTTP server. Refused, reset, a failed TLS handshake or an answer
# that is not HTTP all read "could not connect"; only a timeout is told apart (the receiver is slow or away).
ERROR_NOT_ALLOWED = "delivery failed: address not allowed"
ERROR_UNRESOLVABLE = "delivery failed: host name does not resolve"
ERROR_CONNECT = "delivery failed: could not connect"
ERROR_TIMEOUT = "delivery failed: timeout"

SIGNATURE_HEADER = "X-Loraplane-Signature"
TIMESTAMP_HEADER = "X-Loraplane-Timestamp"
EVENT_HEADER = "X-Loraplane-Event"
DELIVERY_HEADER = "X-Loraplane-Delivery"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """`v1=` and the hex HMAC-SHA256 of `"{timestamp}.{body}"` under the endpoint's secret. The timestamp is signed
    too, so a receiver that refuses old timestamps cannot be fed a recorded delivery again later."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={mac}"


def verify(secret: str, timestamp: str, body: bytes, signature: str, *, now: float | None = None,
           tolerance_s: float = 300.0) -> bool:
    """What a receiver does: the signature matches (compared in constant time) and the timestamp is recent."""
    if not timestamp.isascii() or not timestamp.isdigit():
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def next_delay(attempts: int, backoff_s: Sequence[float] = BACKOFF_S) -> float | None:
    """Seconds until the next attempt after `attempts` failed ones; None: that was the last (len(backoff_s) + 1)."""
    if attempts < 1:
        return 0.0
    return backoff_s[attempts - 1] if attempts <= len(backoff_s) else None


def encode_body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def request_headers(*, secret: str, delivery_id: str, event_type: str, body: bytes, timestamp: int) -> dict[str, str]:
    return {"Content-Type": "application/json", "User-Agent": "loraplane-webhooks/1",
            TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: sign(secret, timestamp, body),
            EVENT_HEADER: event_type, DELIVERY_HEADER: delivery_id}


def pinned_request(client: httpx.Client, target: Target, address: IPAddress, *, content: bytes,
                   headers: dict[str, str], method: str = "POST") -> httpx.Request:
    """A request (a POST by default) to `target.url` that connects to `address`, one of the checked addresses of its
    host, while the server still sees the URL's own host: the URL's host is swapped for the address (so httpx
    connects there and resolves nothing), `Host` keeps the original name, and for https the `sni_hostname` extension
    makes httpcore send the original name in the TLS handshake and verify the certificate against it (ssl's
    `server_hostname`), not against the address. All of it is httpx's public API; no second resolution happens
    anywhere."""
    url = target.url.copy_with(host=str(address))
    extensions = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
    return client.build_request(method, url, content=content, extensions=extensions,
                                headers={**headers, "Host": target.url.netloc.decode("ascii")})


@dataclass(frozen=True)
class Claimed:
    """A delivery this sender holds until `CLAIM_S` after it took it, with what sending it needs."""

    delivery_id: str
    url: str
    secret_encrypted: str  # decrypted only to sign (common/secret_box.py)
    event_type: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    status_code: int | None  # None: no answer (refused before connecting, could not connect, timeout, ...)
    error: str | None  # None: a 2xx. Shown to the tenant: one of the ERROR_ texts or "HTTP <status>"

    @property
    def delivered(self) -> bool:
        return self.error is None


class WebhookSender:
    def __init__(self, *, backoff_s: Sequence[float] = BACKOFF_S, claim_s: float = CLAIM_S,
                 timeout_s: float = TIMEOUT_S, idle_poll_s: float = IDLE_POLL_S, egress: Egress | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        """`egress`: the address check, the settings' allow-list and the system's resolver by default. `verify`:
        how https receivers' certificates are checked (the system's CAs by default; a test passes its own CA)."""
        self.backoff_s = tuple(backoff_s)
        self.claim_s = claim_s
        self.idle_poll_s = idle_poll_s
        self.egress = egress or Egress(policy=get_settings().webhook_egress_policy,
                                       lookups=ThreadPoolExecutor(max_workers=2, thread_name_prefix="webhook-resolve"))
        # An explicit transport, and trust_env off: no proxy from the environment (it would resolve the name again,
        # out of our sight) and no .netrc credentials. No kept-alive connections: the pool is keyed by the address
        # we connect to, so a kept connection (its TLS made for one host name) could carry another host's delivery
        # that resolves to the same address; and each attempt goes to an address checked just before it.
        # No redirects: a 3xx is an answer to fix at the receiver, not a place to send the signed body to.
        transport = httpx.HTTPTransport(verify=verify, limits=httpx.Limits(max_keepalive_connections=0))
        self.http = httpx.Client(transport=transport, timeout=timeout_s, follow_redirects=False, trust_env=False)

    def claim(self, now: datetime) -> Claimed | None:
        """Takes the next due delivery (its row locked, skipping rows another sender holds) and commits the claim."""
        with session_scope() as session:
            row = session.execute(
                select(WebhookDelivery, WebhookEndpoint)
                .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
                .where(WebhookDelivery.state == DELIVERY_PENDING, WebhookDelivery.next_attempt_at <= now)
                .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
                .limit(1)
                .with_for_update(of=WebhookDelivery, skip_locked=True, key_share=True)
            ).first()
            if row is None:
                return None
            delivery, endpoint = row
            delivery.next_attempt_at = now + timedelta(seconds=self.claim_s)
            return Claimed(delivery_id=delivery.id, url=endpoint.url, secret_encrypted=endpoint.secret_encrypted,
                           event_type=delivery.event_type, payload=dict(delivery.payload))

    def send(self, claimed: Claimed) -> Outcome:
        # A secret no configured key decrypts raises here, after the claim was committed: the operator's log
        # says so, and the delivery waits out its claim without spending an attempt (the tenant did nothing wrong).
        secret = get_secret_box().decrypt(claimed.secret_encrypted)
        try:
            target = self.egress.target(claimed.url)
        except EgressRefused as exc:
            log.warning("webhook delivery %s to %s refused before connecting: %s", claimed.delivery_id, claimed.url,
                        exc)
            return Outcome(None, ERROR_NOT_ALLOWED if exc.code == NOT_ALLOWED else ERROR_UNRESOLVABLE)
        body = encode_body(claimed.payload)
        headers = request_headers(secret=secret, delivery_id=claimed.delivery_id, event_type=claimed.event_type,
                                  body=body, timestamp=int(time.time()))
        return self.post(claimed.delivery_id, target, body, headers)

    def post(self, delivery_id: str, target: Target, body: bytes, headers: dict[str, str]) -> Outcome:
        """POSTs to the target's checked addresses in the resolver's order, moving on only when one cannot be
        connected to at all (a host whose IPv6 address is unreachable from here, say). The answer's body is never
        read: its status is all a delivery needs, and a receiver cannot make the sender hold a large body."""
        for address in target.addresses:
            request = pinned_request(self.http, target, address, content=body, headers=headers)
            try:
                response = self.http.send(request, stream=True)
            except httpx.ConnectError as exc:  # refused, unreachable, reset or a failed TLS handshake: all alike
                log.info("webhook delivery %s: %s (%s) could not be connected to: %r", delivery_id, target.host,
                         address, exc)
                continue
            except httpx.TimeoutException as exc:
                log.info("webhook delivery %s: %s (%s) timed out: %r", delivery_id, target.host, address, exc)
                return Outcome(None, ERROR_TIMEOUT)
            except httpx.HTTPError as exc:
                log.info("webhook delivery %s: %s (%s) gave no valid answer: %r", delivery_id, target.host,
                         address, exc)
                return Outcome(None, ERROR_CONNECT)
            response.close()
            if 200 <= response.status_code < 300:
                return Outcome(response.status_code, None)
            return Outcome(response.status_code, f"HTTP {response.status_code}")
        return Outcome(None, ERROR_CONNECT)  # no address could be connected to

    def record(self, claimed: Claimed, outcome: Outcome, now: datetime) -> None:
        """The attempt, and what comes next: delivered, another try after the backoff, or failed."""
        with session_scope() as session:
            delivery = session.get(WebhookDelivery, claimed.delivery_id, with_for_update={"key_share": True})
            if delivery is None or delivery.state != DELIVERY_PENDING:
                return  # its endpoint was deleted meanwhile, or another sender got there first (a claim ran out)
            delivery.attempts += 1
            delivery.last_attempt_at = now
            delivery.last_status_code = outcome.status_code
            delivery.last_error = outcome.error
            delay = next_delay(delivery.attempts, self.backoff_s)
            if outcome.delivered:
                delivery.state, delivery.delivered_at, delivery.next_attempt_at = DELIVERY_DELIVERED, now, None
            elif delay is None:
                delivery.state, delivery.next_attempt_at = DELIVERY_FAILED, None
                log.warning("webhook delivery %s to %s failed for good after %d attempts: %s",
                            delivery.id, claimed.url, delivery.attempts, outcome.error)
            else:
                delivery.next_attempt_at = now + timedelta(seconds=delay)

    def run_once(self, now: datetime | None = None, limit: int = 100) -> int:
        """Sends what is due (at `now`, the clock by default), one delivery at a time, so each claim covers one
        POST. Returns how many were attempted."""
        done = 0
        while done < limit:
            at = now or utcnow()
            claimed = self.claim(at)
            if claimed is None:
                break
            outcome = self.send(claimed)
            self.record(claimed, outcome, now or utcnow())
            done += 1
        return done

    def run(self, stop: threading.Event) -> None:
        log.info("webhook sender running")
        try:
            while not stop.is_set():
                try:
                    sent = self.run_once()
                except Exception:  # noqa: BLE001 - the database is away, say: claims run out, nothing is lost
                    log.exception("webhook round failed; retrying")
                    sent = 0
                if not sent:
                    stop.wait(self.idle_poll_s)
        finally:
            self.http.close()
