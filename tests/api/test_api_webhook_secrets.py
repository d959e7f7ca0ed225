"""Webhook secrets encrypted at rest (issue 29): the database row is not the secret, deliveries still verify with the
secret shown at creation, `loraplane rotate-secrets` moves every row to a new key while the old one keeps them
readable, a secret no key decrypts spends no attempt, and a distributed process without the key does not start.

Real API (in-process), PostgreSQL, sender, `loraplane` processes and an HTTP receiver on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from cryptography.fernet import Fernet, InvalidToken
from fastapi.testclient import TestClient
from sqlalchemy import text

from common.db import get_engine
from common.secret_box import SETTING, SecretKeyError, SecretUnreadable, get_secret_box
from common.settings import get_settings
from common.tables import utcnow
from scheduler.service.webhooks import CLAIM_S, WebhookSender
from tests.api.test_api_webhooks import Receiver, assert_signed, cancel, deliveries, register, serve_receiver
from tests.e2e.procs import ROOT
from tests.egress import allowed_networks
from tests.factories import TenantKey


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serve_receiver() as rec, allowed_networks("127.0.0.1"):
        yield rec


@contextmanager
def secret_keys(value: str | None) -> Iterator[None]:
    """LORAPLANE_SECRET_KEY as an operator would set it (None: unset), read again by this process's settings and
    box for the block; the run's key again after."""
    before = os.environ.get(SETTING)
    if value is None:
        os.environ.pop(SETTING, None)
    else:
        os.environ[SETTING] = value
    get_settings.cache_clear()
    get_secret_box.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SETTING, None)
        else:
            os.environ[SETTING] = before
        get_settings.cache_clear()
        get_secret_box.cache_clear()


def stored_secret(webhook_id: str) -> str:
    with get_engine().connect() as conn:
        return str(conn.execute(text("SELECT secret_encrypted FROM webhook_endpoints WHERE id = :id"),
                                {"id": webhook_id}).scalar_one())


def loraplane(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loraplane.cli", *args], cwd=ROOT, env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_database_keeps_the_secret_encrypted_and_deliveries_verify_with_the_shown_one(
    client: TestClient, tenant: TenantKey, receiver: Receiver
) -> None:
    hook = register(client, tenant, receiver.url)
    stored = stored_secret(hook["id"])
    assert hook["secret"] not in stored
    with get_engine().connect() as conn:  # in no column of the row
        row = conn.execute(text("SELECT * FROM webhook_endpoints WHERE id = :id"), {"id": hook["id"]}).one()
    assert all(hook["secret"] not in str(value) for value in row)
    assert Fernet(os.environ[SETTING]).decrypt(stored.encode()).decode() == hook["secret"]  # under the run's key
    cancel(client, tenant)
    assert WebhookSender().run_once() == 1
    assert_signed(receiver.requests[0], hook["secret"])


def test_rotation_keeps_old_secrets_readable_and_moves_them_to_the_new_key(
    client: TestClient, tenant: TenantKey, receiver: Receiver
) -> None:
    old, new = os.environ[SETTING], Fernet.generate_key().decode()
    first = register(client, tenant, receiver.url, events=["task.cancelled"])  # under the old key
    cancel(client, tenant)
    with secret_keys(f"{new},{old}"):  # step 1: the new key first, the old one still there
        assert WebhookSender().run_once() == 1  # an old row is still read
        assert_signed(receiver.requests[-1], first["secret"])
        second = register(client, tenant, receiver.url, events=["task.cancelled"])  # under the new key
        Fernet(new).decrypt(stored_secret(second["id"]).encode())
        rotated = loraplane("rotate-secrets")  # step 2, the real command
        assert rotated.returncode == 0, rotated.stderr
        assert "1 re-encrypted under the first key, 1 already under it" in rotated.stdout
    stored = stored_secret(first["id"])
    assert Fernet(new).decrypt(stored.encode()).decode() == first["secret"]
    with pytest.raises(InvalidToken):
        Fernet(old).decrypt(stored.encode())
    with secret_keys(new):  # step 3: the old key dropped; every row still signs
        cancel(client, tenant)
        assert WebhookSender().run_once() == 2
    by_hook = {r["headers"]["X-Loraplane-Delivery"]: r for r in receiver.requests[-2:]}
    for hook in (first, second):
        (d,) = [d for d in deliveries(client, tenant, hook["id"]) if d["id"] in by_hook]
        assert_signed(by_hook[d["id"]], hook["secret"])


def test_a_secret_no_key_decrypts_spends_no_attempt_and_rotation_names_it(
    client: TestClient, tenant: TenantKey, receiver: Receiver
) -> None:
    hook = register(client, tenant, receiver.url)
    cancel(client, tenant)
    t0 = utcnow()
    with secret_keys(Fernet.generate_key().decode()):  # the key it was encrypted with was dropped too early
        with pytest.raises(SecretUnreadable):
            WebhookSender().run_once(now=t0)
        rotated = loraplane("rotate-secrets")
        assert rotated.returncode == 1 and hook["id"] in rotated.stderr and "decrypt under no key" in rotated.stderr
    (d,) = deliveries(client, tenant, hook["id"])
    assert (d["state"], d["attempts"], d["last_error"]) == ("pending", 0, None)  # the tenant did nothing wrong
    assert receiver.requests == []
    # The right key back: sent once the claim runs out.
    assert WebhookSender().run_once(now=t0 + timedelta(seconds=CLAIM_S + 1)) == 1
    assert_signed(receiver.requests[0], hook["secret"])


def test_a_distributed_process_without_the_key_does_not_start() -> None:
    env = {k: v for k, v in os.environ.items() if k != SETTING}
    assert env["DATABASE_URL"]  # the distributed mode
    for command in (["scheduler"], ["api", "--port", "1"], ["rotate-secrets"]):
        result = loraplane(*command, env=env)
        assert result.returncode != 0
        assert f"{SETTING} is not set" in result.stderr and "share one key" in result.stderr, result.stderr
    malformed = loraplane("scheduler", env={**env, SETTING: "not-a-fernet-key"})
    assert malformed.returncode != 0 and "key 1 of 1 is not a Fernet key" in malformed.stderr
    assert "not-a-fernet-key" not in malformed.stderr  # a key, even a wrong one, is never echoed
    # The app itself (uvicorn api.main:app) refuses in its start-up too.
    from api.main import create_app

    with secret_keys(None), pytest.raises(SecretKeyError), TestClient(create_app()):
        pass
