"""Webhooks cannot be aimed inward (issue 29): registration refuses every inward address form, the sender checks
again at each attempt before it connects and connects to the address it checked, the operator's allow-list lets
named networks or hosts through, and the delivery log never carries connection details.

Real API (in-process), PostgreSQL, sender and HTTP(S) receivers on 127.0.0.1. Host names resolve through the seam
(tests/egress.py), never through DNS; no test sends anything to an address that is not loopback: the inward
addresses below are only ever checked, and refusals are decided before any connection.
"""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient

from common.egress import RESOLVE_TIMEOUT_S, Egress
from common.settings import get_settings
from common.tables import utcnow
from scheduler.service.webhooks import WebhookSender
from tests.api.test_api_webhooks import assert_signed, cancel, deliveries, register, serve_receiver
from tests.egress import PUBLIC_ADDRESS, TableResolver, allowed_networks
from tests.factories import TenantKey

NOT_PUBLIC = "url: the host is not a public address; webhooks are sent to public addresses only."
LATER = dt.timedelta(hours=1)  # past any backoff: the next attempt is due


def sender(resolver: TableResolver, **kwargs: object) -> WebhookSender:
    """The sender as the scheduler runs it (the settings' allow-list), resolving through the test's table."""
    return WebhookSender(egress=Egress(policy=get_settings().webhook_egress_policy, resolver=resolver),
                         **kwargs)  # type: ignore[arg-type]


# ---- registration --------------------------------------------------------------------------------------------

INWARD_URLS = [
    "http://127.0.0.1:{port}/hook", "http://127.1:{port}/hook", "http://0x7f000001:{port}/hook",
    "http://2130706433:{port}/hook", "http://[::1]:{port}/hook", "http://[::ffff:127.0.0.1]:{port}/hook",
    "http://0.0.0.0:{port}/hook", "http://localhost:{port}/hook", "http://LOCALHOST.:{port}/hook",
    "http://10.0.0.1/hook", "http://172.16.0.1/hook", "http://192.168.1.1/hook",
    "http://169.254.169.254/latest/meta-data/", "http://metadata.google.internal/computeMetadata/v1/",
    "https://[64:ff9b::a9fe:a9fe]/", "http://100.64.0.1/hook", "http://[fe80::1]/hook", "http://[fc00::1]/hook",
    "http://224.0.0.1/hook", "http://[2002:7f00:1::]:{port}/hook", "https://mixed.example/hook",
    "https://user:pw@internal.example:8443/hook",
]


@pytest.mark.parametrize("url", INWARD_URLS)
def test_registration_refuses_every_inward_address_form(
    client: TestClient, tenant: TenantKey, resolver: TableResolver, url: str
) -> None:
    resolver.names.update({"mixed.example": [PUBLIC_ADDRESS, "10.1.2.3"], "internal.example": ["192.168.0.10"]})
    with serve_receiver() as rec:  # the loopback forms aim at a live port: nothing may reach it
        port = rec.url.rsplit(":", 1)[1].split("/")[0]
        r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": url.format(port=port)})
        assert r.status_code == 422, r.text
        # The one error shape, a rule the tenant can act on, and nothing the tenant did not send (no address a
        # name resolved to).
        assert r.json() == {"error": {"type": "invalid_request_error", "code": "url_not_allowed", "param": "url",
                                      "message": NOT_PUBLIC}}
        assert client.get("/v1/webhooks", headers=tenant.headers).json()["data"] == []
        assert rec.requests == []


def test_registration_refuses_a_name_that_does_not_resolve(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": "https://nowhere.invalid/hook"})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("url_unresolvable", "url") and "does not resolve" in error["message"]


def test_a_name_whose_dns_never_answers_is_refused_in_bounded_time(client: TestClient, tenant: TenantKey) -> None:
    """The lookup runs in a thread with a limit (getaddrinfo has none): the request is answered, not held."""
    from api.deps import name_resolver

    release = threading.Event()

    def never_answers(_host: str, _port: int) -> list[str]:
        release.wait(60)
        return [PUBLIC_ADDRESS]

    client.app.dependency_overrides[name_resolver] = lambda: never_answers  # type: ignore[attr-defined]
    t0 = time.monotonic()
    try:
        r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": "https://slow.example/hook"})
    finally:
        release.set()
    elapsed = time.monotonic() - t0
    assert r.status_code == 422 and r.json()["error"]["code"] == "url_unresolvable", r.text
    assert RESOLVE_TIMEOUT_S <= elapsed < RESOLVE_TIMEOUT_S + 5, elapsed


def test_the_allow_list_admits_named_networks_and_hosts_only(
    client: TestClient, tenant: TenantKey, resolver: TableResolver
) -> None:
    resolver.names["hooks.internal"] = ["10.20.0.5"]
    with allowed_networks("10.20.0.0/16,metadata.google.internal"):
        for url in ("http://10.20.30.40/hook", "https://hooks.internal/hook", "http://metadata.google.internal/"):
            assert client.post("/v1/webhooks", headers=tenant.headers, json={"url": url}).status_code == 201, url
        for url in ("http://10.21.0.1/hook", "http://127.0.0.1/hook", "http://169.254.169.254/"):
            r = client.post("/v1/webhooks", headers=tenant.headers, json={"url": url})
            assert r.status_code == 422 and r.json()["error"]["code"] == "url_not_allowed", url


# ---- sending ---------------------------------------------------------------------------------------------------


def test_a_name_that_turns_inward_after_registration_is_refused_before_connecting(
    client: TestClient, tenant: TenantKey, resolver: TableResolver
) -> None:
    with serve_receiver() as rec:
        port = rec.url.rsplit(":", 1)[1].split("/")[0]
        resolver.names["hooks.example"] = [PUBLIC_ADDRESS]  # public when registered ...
        hook = register(client, tenant, f"http://hooks.example:{port}/hook", events=["task.cancelled"])
        cancel(client, tenant)
        resolver.names["hooks.example"] = ["127.0.0.1"]  # ... and inward by the time it is sent (rebinding)
        t0 = utcnow()
        assert sender(resolver).run_once(now=t0) == 1
        assert rec.requests == []  # refused before connecting: the live port saw nothing
        (d,) = deliveries(client, tenant, hook["id"])
        assert (d["state"], d["attempts"], d["last_status_code"], d["last_error"]) == (
            "pending", 1, None, "delivery failed: address not allowed")

        # The operator allows the name: the same delivery arrives, signed, at the address the sender checked
        # (the name resolves nowhere but in the table), with the name in its Host header.
        with allowed_networks("hooks.example"):
            assert sender(resolver).run_once(now=t0 + LATER) == 1
        (request,) = rec.requests
        assert_signed(request, hook["secret"])
        assert request["headers"]["Host"] == f"hooks.example:{port}"
        (d,) = deliveries(client, tenant, hook["id"])
        assert (d["state"], d["attempts"], d["last_error"]) == ("delivered", 2, None)


def test_an_address_literal_is_checked_at_send_too(client: TestClient, tenant: TenantKey,
                                                   resolver: TableResolver) -> None:
    """Registered while the operator allowed loopback, sent after the allowance was withdrawn: refused."""
    with serve_receiver() as rec:
        with allowed_networks("127.0.0.1"):
            hook = register(client, tenant, rec.url)
        cancel(client, tenant)
        assert sender(resolver).run_once() == 1
        assert rec.requests == []
        (d,) = deliveries(client, tenant, hook["id"])
        assert d["last_error"] == "delivery failed: address not allowed"


@contextmanager
def silent_server(mode: str) -> Iterator[int]:
    """A loopback port that accepts connections and then never answers ("hang") or closes them at once ("close")."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if mode == "close":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # linger 0: a reset
            else:
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        server.close()
        for conn in held:
            conn.close()
        thread.join(5)


def test_the_delivery_log_tells_no_connection_details(client: TestClient, tenant: TenantKey,
                                                      resolver: TableResolver) -> None:
    """A closed port, a reset and a server that answers nothing read alike (a tenant cannot tell an open port from a
    closed one); a timeout says timeout. The socket's own error goes to the operator's log only."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: connection refused
    with allowed_networks("127.0.0.1"), silent_server("close") as reset_port, silent_server("hang") as hang_port:
        hooks = {name: register(client, tenant, f"http://127.0.0.1:{port}/hook", events=["task.cancelled"])
                 for name, port in (("refused", closed_port), ("reset", reset_port), ("hang", hang_port))}
        cancel(client, tenant)
        assert sender(resolver, timeout_s=1.0).run_once() == 3
    errors = {name: deliveries(client, tenant, hook["id"])[0]["last_error"] for name, hook in hooks.items()}
    assert errors == {"refused": "delivery failed: could not connect", "reset": "delivery failed: could not connect",
                      "hang": "delivery failed: timeout"}


# ---- https: the connection goes to the checked address, TLS still names the host -----------------------------


def tls_files(tmp_path: Path, hostname: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A test CA and a server certificate for `hostname` signed by it: (the server's context, a client context
    that trusts the CA and nothing else)."""
    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("loraplane test CA")).issuer_name(name("loraplane test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name(hostname)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = tmp_path / f"{hostname}.pem", tmp_path / f"{hostname}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


def test_https_goes_to_the_checked_address_with_the_host_name_in_sni_and_the_certificate_check(
    client: TestClient, tenant: TenantKey, resolver: TableResolver, tmp_path: Path
) -> None:
    server_tls, trusting = tls_files(tmp_path, "hooks.example")
    sni: list[str | None] = []
    server_tls.sni_callback = lambda _sock, name, _ctx: sni.append(name)
    resolver.names.update({"hooks.example": ["127.0.0.1"], "other.example": ["127.0.0.1"]})
    with serve_receiver(server_tls) as rec, allowed_networks("127.0.0.1"):
        port = rec.url.rsplit(":", 1)[1].split("/")[0]
        hook = register(client, tenant, f"https://hooks.example:{port}/hook", events=["task.cancelled"])
        # The same receiver under a name its certificate does not carry: the certificate is checked against the
        # URL's name, not the address connected to, so this one must fail.
        wrong = register(client, tenant, f"https://other.example:{port}/hook", events=["task.cancelled"])
        cancel(client, tenant)
        assert sender(resolver, verify=trusting).run_once() == 2
    (request,) = rec.requests
    assert_signed(request, hook["secret"])
    assert request["headers"]["Host"] == f"hooks.example:{port}"
    assert sorted(sni) == ["hooks.example", "other.example"]  # type: ignore[type-var]
    assert deliveries(client, tenant, hook["id"])[0]["state"] == "delivered"
    (d,) = deliveries(client, tenant, wrong["id"])
    assert (d["state"], d["last_error"]) == ("pending", "delivery failed: could not connect")
