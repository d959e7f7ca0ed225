"""Builders for API tests: tenants with keys, datasets, tasks, and direct database edits that stand in
for the scheduler and workers (trial progress, events, adapters)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.testclient import TestClient

ADMIN_TOKEN = "test-admin-token"  # set by tests/conftest.py
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass(frozen=True)
class TenantKey:
    id: str
    name: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def make_tenant(client: TestClient, name: str | None = None, **fields: Any) -> TenantKey:
    name = name or f"tenant-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/admin/tenants", json={"name": name, **fields}, headers=ADMIN)
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    r = client.post(f"/v1/admin/tenants/{tenant_id}/api-keys", json={"name": "tests"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return TenantKey(id=tenant_id, name=name, key=r.json()["key"], key_id=r.json()["id"])


def chat_rows(n: int = 10) -> bytes:
    rows = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(n)
    ]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def prompt_rows(n: int = 10) -> bytes:
    return "\n".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) for i in range(n)).encode()


def upload(client: TestClient, tenant: TenantKey, data: bytes | None = None, filename: str = "train.jsonl") -> dict:
    r = client.post(
        "/v1/files", headers=tenant.headers, files={"file": (filename, data if data is not None else chat_rows())}
    )
    assert r.status_code == 201, r.text
    return r.json()


def task_body(training_file: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "base_model": "tiny-random-llama",
        "training_file": training_file,
        "search_space": {"learning_rate": [1e-4, 3e-4], "lora_rank": [8, 16]},
        "epochs": 2,
    }
    body.update(overrides)
    return body


def make_task(client: TestClient, tenant: TenantKey, file_id: str | None = None, **overrides: Any) -> dict:
    file_id = file_id or upload(client, tenant)["id"]
    r = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, **overrides))
    assert r.status_code == 201, r.text
    return r.json()


# ---- direct database edits (what the scheduler and workers would do) ----------------------------------


def update_row(model: Any, row_id: str, **fields: Any) -> None:
    from common.db import session_scope

    with session_scope() as session:
        row = session.get(model, row_id)
        assert row is not None, row_id
        for name, value in fields.items():
            setattr(row, name, value)


def add_events(tenant_id: str, task_id: str, types: list[str]) -> list[int]:
    from common.db import session_scope
    from common.events import record_event

    with session_scope() as session:
        events = [
            record_event(session, tenant_id=tenant_id, task_id=task_id, type=t, message=f"{t} happened",
                         data={"n": i})
            for i, t in enumerate(types)
        ]
        session.flush()
        return [e.id for e in events]


def trial_ids(task_id: str) -> list[str]:
    from sqlalchemy import select

    from common.db import session_scope
    from common.tables import Trial

    with session_scope() as session:
        return list(session.scalars(select(Trial.id).where(Trial.task_id == task_id).order_by(Trial.index)))


def store_adapter(task_id: str, trial_id: str, payload: bytes = b"\x1f\x8b fake adapter archive") -> bytes:
    """Puts an archive where a worker would, and points the trial (and the task's best) at it."""
    from common.artifacts import adapter_key, get_artifact_store
    from common.tables import Task, Trial

    key = adapter_key(task_id, trial_id)
    get_artifact_store().put_bytes(key, payload)
    update_row(Trial, trial_id, adapter_key=key)
    update_row(Task, task_id, best_trial_id=trial_id)
    return payload


def count_rows(model: Any) -> int:
    from sqlalchemy import func, select

    from common.db import session_scope

    with session_scope() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)
