"""The operator's cluster page shows a quarantined worker (issue 29): a worker that lost packs repeatedly gets no pack
until its quarantine ends, and the page says so with the time it ends; lifted (the admin API), it shows alive again.
Headless Chromium against `loraplane up` (conftest.py); the quarantine is written into the service's database, as
the scheduler writes it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from common.tables import Worker, utcnow
from tests.dashboard.conftest import WORKER_ID, Service, missing_requirement
from tests.dashboard.test_dashboard import shot, sign_in

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)


def test_the_cluster_page_shows_a_quarantined_worker_until_it_is_lifted(
    page: Any, service: Service, service_db: Engine
) -> None:
    engine = service_db  # the session's one engine (conftest.py): closing one mid-run upsets the service's
    admin = {"Authorization": f"Bearer {service.admin_token}"}
    try:
        sign_in(page, service.admin_token)
        expect(page.get_by_role("heading", name="Cluster")).to_be_visible()
        worker = page.locator(f"#workers tr[data-worker='{WORKER_ID}']")
        expect(worker).to_contain_text("alive", timeout=30_000)
        now = utcnow()
        with Session(engine) as session, session.begin():
            row = session.get_one(Worker, WORKER_ID)
            row.quarantined_until = now + timedelta(minutes=10)
            row.lost_packs = [now.timestamp() - 30, now.timestamp() - 20, now.timestamp() - 10]
        expect(worker).to_contain_text("quarantined until", timeout=15_000)  # the page re-reads every 5 s
        expect(worker.locator(".state-quarantined")).to_have_count(1)
        expect(page.locator(".stat", has_text="workers quarantined")).to_contain_text("1")
        shot(page, "06-cluster-quarantine")
    finally:
        assert httpx.delete(f"{service.base_url}/v1/admin/workers/{WORKER_ID}/quarantine",
                            headers=admin).status_code == 200
    expect(worker).not_to_contain_text("quarantined", timeout=15_000)
    expect(worker).to_contain_text("alive")
