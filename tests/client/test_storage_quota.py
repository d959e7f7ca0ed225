"""The storage quota through the client and the CLI: set at creation, shown, and answered as typed errors."""

from __future__ import annotations

import json

import pytest

from loraplane.cli import main
from loraplane.client import Client
from loraplane.client.errors import APIError
from tests.conftest import ADMIN_TOKEN
from tests.factories import chat_rows


def test_the_cli_creates_and_shows_a_tenant_with_a_storage_quota(
    api_url: str, clean_db: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLANE_API_URL", api_url)
    code = main(["admin", "tenants", "create", "acme", "--max-storage-bytes", "3000000", "--max-files", "7",
                 "--json"])
    created = json.loads(capsys.readouterr().out)
    assert code == 0 and (created["max_storage_bytes"], created["max_files"]) == (3_000_000, 7)
    assert main(["admin", "tenants", "show", "acme"]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert "MAX STORAGE" in header and "MAX FILES" in header
    assert row.split()[-5:-2] == ["3.0", "MB", "7"]  # MAX STORAGE, MAX FILES, then CREATED (a date and a time)


def test_the_client_sets_the_quota_and_sees_the_refusal(api_url: str, clean_db: None) -> None:
    with Client(api_url, admin_token=ADMIN_TOKEN) as admin:
        tenant = admin.admin.create_tenant("initech", max_files=1, max_storage_bytes=10_000)
        assert (tenant.max_files, tenant.max_storage_bytes) == (1, 10_000)
        assert admin.admin.update_tenant(tenant.id, max_files=2).max_files == 2
        key = admin.admin.create_api_key(tenant.id).key
    with Client(api_url, key) as lp:
        lp.files.upload(chat_rows(2), filename="a.jsonl")
        lp.files.upload(chat_rows(2), filename="b.jsonl")
        with pytest.raises(APIError) as refused:
            lp.files.upload(chat_rows(2), filename="c.jsonl")
    assert (refused.value.status_code, refused.value.code) == (429, "file_quota_exceeded")
