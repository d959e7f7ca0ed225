"""Revision 0014 encrypts the webhook secrets a database at 0013 keeps in plaintext, under the configured key, and
its downgrade decrypts them again, on SQLite and on Postgres."""

from __future__ import annotations

import os

from cryptography.fernet import Fernet
from sqlalchemy import inspect, text

from common.db import make_engine
from tests.common.conftest import alembic

PLAINTEXT = "whsec_" + "k" * 43


def _secret_column(url: str) -> tuple[str, str]:
    engine = make_engine(url)
    try:
        columns = {c["name"] for c in inspect(engine).get_columns("webhook_endpoints")}
        (name,) = columns & {"secret", "secret_encrypted"}
        with engine.connect() as conn:
            value = conn.execute(text(f"SELECT {name} FROM webhook_endpoints WHERE id = 'wh-old'")).scalar_one()
        return name, str(value)
    finally:
        engine.dispose()


def test_0014_encrypts_plaintext_secrets_and_the_downgrade_decrypts_them(scratch_url: str) -> None:
    alembic(scratch_url, "upgrade", "0013")
    engine = make_engine(scratch_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, weight, max_concurrent_trials, max_trials_per_task, "
                          "max_file_bytes, max_storage_bytes, max_files, created_at) "
                          "VALUES ('t-old', 'old', 1, 1, 1, 1, 1, 1, CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO webhook_endpoints (id, tenant_id, url, events, description, secret, created_at) "
                          "VALUES ('wh-old', 't-old', 'https://example.com/h', '[]', '', :s, CURRENT_TIMESTAMP)"),
                     {"s": PLAINTEXT})
    engine.dispose()

    alembic(scratch_url, "upgrade", "0014")
    name, stored = _secret_column(scratch_url)
    assert name == "secret_encrypted" and PLAINTEXT not in stored
    assert Fernet(os.environ["LORAPLANE_SECRET_KEY"]).decrypt(stored.encode()).decode() == PLAINTEXT

    alembic(scratch_url, "downgrade", "0013")
    assert _secret_column(scratch_url) == ("secret", PLAINTEXT)
    alembic(scratch_url, "upgrade", "head")
    assert _secret_column(scratch_url)[0] == "secret_encrypted"


def test_0014_on_a_database_without_webhooks_needs_no_key(scratch_url: str) -> None:
    """A fresh install migrates before any key is configured (the k8s migrate job, say): nothing to encrypt, so the
    key is not asked for (DATABASE_URL is set: the distributed mode, where a missing key is an error)."""
    from common.settings import get_settings

    key = os.environ.pop("LORAPLANE_SECRET_KEY")
    get_settings.cache_clear()
    try:
        alembic(scratch_url, "upgrade", "head")
    finally:
        os.environ["LORAPLANE_SECRET_KEY"] = key
        get_settings.cache_clear()
    engine = make_engine(scratch_url)
    try:
        assert "secret_encrypted" in {c["name"] for c in inspect(engine).get_columns("webhook_endpoints")}
    finally:
        engine.dispose()
