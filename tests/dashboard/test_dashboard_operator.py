"""The operator (admin token) in headless Chromium against `loraplane up` (issue 32, point 5): every tenant's tasks
with their tenant, filtered by tenant, and a tenant's task page (its trials, curves and events) read-only, each read
in the audit log. Any console error fails the test (conftest.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import Service, missing_requirement
from tests.dashboard.test_dashboard import shot, sign_in
from tests.e2e.flow import arithmetic_rows

if (missing := missing_requirement()) is not None:
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402  (only once we know it is installed)


def _long_task(service: Service, key: str) -> dict[str, Any]:
    """Two trials that keep training while the operator looks (cancelled at the end)."""
    tenant = {"Authorization": f"Bearer {key}"}
    file_id = httpx.post(f"{service.base_url}/v1/files", headers=tenant,
                         files={"file": ("operator.jsonl", arithmetic_rows())}).json()["id"]
    answer = httpx.post(f"{service.base_url}/v1/tasks", headers=tenant, json={
        "base_model": "tiny-random-llama", "training_file": file_id, "validation_split": 0.2,
        "search_space": {"lora_rank": [2, 4]}, "max_steps": 5000, "max_seq_len": 32})
    assert answer.status_code == 201, answer.text
    task: dict[str, Any] = answer.json()
    return task


def _other_tenants_cancelled_task(service: Service) -> tuple[str, dict[str, Any]]:
    """A second tenant (its name) with a task cancelled at once: the operator's list shows both tenants' tasks."""
    admin = {"Authorization": f"Bearer {service.admin_token}"}
    other = httpx.post(f"{service.base_url}/v1/admin/tenants", headers=admin, json={"name": "operator-view-other"})
    assert other.status_code == 201, other.text
    key = httpx.post(f"{service.base_url}/v1/admin/tenants/{other.json()['id']}/api-keys", headers=admin,
                     json={}).json()["key"]
    task = _long_task(service, key)
    cancelled = httpx.post(f"{service.base_url}/v1/tasks/{task['id']}/cancel",
                           headers={"Authorization": f"Bearer {key}"})
    assert cancelled.status_code == 200, cancelled.text
    return other.json()["name"], task


def test_the_operator_reads_a_tenants_task_read_only_and_it_is_audited(page: Any, service: Service) -> None:
    admin = {"Authorization": f"Bearer {service.admin_token}"}
    tenant = {"Authorization": f"Bearer {service.tenant_key}"}
    other_name, other_task = _other_tenants_cancelled_task(service)
    task = _long_task(service, service.tenant_key)
    try:
        sign_in(page, service.admin_token)
        expect(page.get_by_role("heading", name="Cluster")).to_be_visible()
        page.get_by_role("navigation", name="Main").get_by_role("link", name="Tasks").click()
        expect(page).to_have_url(f"{service.base_url}/#/tasks")  # no longer sent back to the cluster page
        row = page.locator(f"#tasks tr[data-task='{task['id']}']")
        expect(row.locator("td.tenant")).to_have_text(service.tenant_name)
        expect(page.locator(f"#tasks tr[data-task='{other_task['id']}'] td.tenant")).to_have_text(other_name)
        expect(page.get_by_role("link", name="New task")).to_have_count(0)  # the operator submits nothing
        expect(page.locator("#operator-note")).to_contain_text("audit log")
        shot(page, "07-operator-tasks")

        # The filter: this tenant's tasks only (the table says which filter its rows were read with).
        page.locator("#tenant-filter").select_option(label=service.tenant_name)
        expect(page.locator("#tasks")).to_have_attribute("data-tenant", task["tenant_id"])
        expect(row).to_be_visible()
        expect(page.locator(f"#tasks tr[data-task='{other_task['id']}']")).to_have_count(0)
        expect(page.locator("#tasks td.tenant").filter(has_not_text=service.tenant_name)).to_have_count(0)

        row.get_by_role("link", name=task["id"]).click()
        expect(page.get_by_role("heading", name=f"Task {task['id']}")).to_be_visible()
        expect(page.locator("#task-tenant")).to_have_text(task["tenant_id"])
        trials = httpx.get(f"{service.base_url}/v1/tasks/{task['id']}/trials", headers=tenant).json()["data"]
        expect(page.locator("#trials tbody tr")).to_have_count(len(trials))
        for trial in trials:
            expect(page.locator(f"#trials tr[data-trial='{trial['id']}']")).to_be_visible()
        expect(page.locator("ol.log li[data-type='task.created']")).to_have_count(1)  # its events, streamed
        expect(page.get_by_role("button", name="Cancel task")).to_have_count(0)  # read-only
        expect(page.locator("#live-mode")).to_have_attribute("data-mode", "stream")
        shot(page, "08-operator-task")
    finally:
        httpx.post(f"{service.base_url}/v1/tasks/{task['id']}/cancel", headers=tenant)

    # What the page read is in the audit log, under the tenant and the task.
    entries = httpx.get(f"{service.base_url}/v1/admin/audit", headers=admin,
                        params={"tenant_id": task["tenant_id"], "limit": 100}).json()["data"]
    read = {e["route"] for e in entries if e["resource_id"] == task["id"]}
    assert {"/v1/tasks/{task_id}", "/v1/tasks/{task_id}/trials", "/v1/tasks/{task_id}/curves",
            "/v1/tasks/{task_id}/events/stream"} <= read, entries
    assert any(e["route"] == "/v1/tasks" and e["tenant_id"] == task["tenant_id"] for e in entries), entries
    # The operator's token cannot cancel for the tenant: the API says so in the one error shape.
    refused = httpx.post(f"{service.base_url}/v1/tasks/{task['id']}/cancel", headers=admin)
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "admin_read_only")
