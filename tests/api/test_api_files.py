"""Uploading, listing and deleting datasets."""

from __future__ import annotations

import hashlib
import json

import pytest
from fastapi.testclient import TestClient

from common.artifacts import file_key, get_artifact_store
from common.tables import File, Task
from tests.factories import ADMIN, TenantKey, chat_rows, count_rows, make_task, prompt_rows, task_body, upload

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}


def _line(obj: object) -> str:
    return json.dumps(obj)


def test_upload_chat_file(client: TestClient, tenant: TenantKey) -> None:
    data = chat_rows(12)
    r = client.post("/v1/files", headers=tenant.headers, files={"file": ("dir/train.jsonl", data)})
    assert r.status_code == 201
    body = r.json()
    assert body["id"].startswith("file-") and body["object"] == "file"
    assert (body["filename"], body["purpose"]) == ("train.jsonl", "fine-tune")
    assert (body["rows"], body["format"]) == (12, "messages")
    assert body["bytes"] == len(data) and body["sha256"] == hashlib.sha256(data).hexdigest()
    assert get_artifact_store().get_bytes(file_key(body["id"])) == data


def test_upload_prompt_completion_file(client: TestClient, tenant: TenantKey) -> None:
    body = upload(client, tenant, prompt_rows(5))
    assert (body["rows"], body["format"]) == (5, "prompt_completion")



def test_a_preference_file_uploads_and_an_sft_task_on_it_is_refused(client: TestClient, tenant: TenantKey) -> None:
    """Preference rows (issue 36) upload and say their format; an SFT task (the default objective) cannot train on
    them (as training or validation file): a 422 naming the file and the DPO objective, nothing created."""
    rows = "".join(_line({"prompt": f"{i} plus 1 is", "chosen": f" {i + 1}", "rejected": f" {i + 2}"}) + "\n"
                   for i in range(6)).encode()
    body = upload(client, tenant, rows, filename="prefs.jsonl")
    assert (body["rows"], body["format"]) == (6, "preference")
    chat = upload(client, tenant, (_line({"messages": [USER], "chosen": ASSISTANT,
                                          "rejected": {"role": "assistant", "content": "bye"}}) + "\n").encode())
    assert chat["format"] == "preference_messages"
    tasks_before = count_rows(Task)
    sft = upload(client, tenant, prompt_rows(8))["id"]
    for fields, param in (({"training_file": body["id"]}, "training_file"),
                          ({"training_file": sft, "validation_file": chat["id"]}, "validation_file")):
        r = client.post("/v1/tasks", headers=tenant.headers, json={**task_body(sft), **fields})
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (422, "preference_rows_need_dpo", param), r.text
        assert "DPO" in error["message"]
    assert count_rows(Task) == tasks_before

@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (b"this is not json\n", 1, "invalid JSON"),
        (f'{_line({"messages": [USER, ASSISTANT]})}\n{_line({"prompt": "a", "completion": "b"})}\n'.encode(), 2,
         "format"),
        (_line({"messages": [{"role": "robot", "content": "x"}, ASSISTANT]}).encode(), 1, "role"),
        (_line({"messages": [USER]}).encode(), 1, "assistant"),
        (_line([1, 2]).encode(), 1, "JSON object"),
        (_line({"text": "x"}).encode(), 1, "messages"),
        (b"", 0, "no rows"),
        (b"\n\n  \n", 0, "no rows"),
        (b"\xff\xfe\x00bad", 1, "UTF-8"),  # the line that is not UTF-8
    ],
    ids=["not-json", "mixed-formats", "bad-role", "no-assistant", "not-object", "no-known-keys", "empty",
         "blank-lines", "not-utf8"],
)
def test_upload_rejects_invalid_data_with_row_errors(
    client: TestClient, tenant: TenantKey, content: bytes, line: int, fragment: str
) -> None:
    r = client.post("/v1/files", headers=tenant.headers, files={"file": ("bad.jsonl", content)})
    assert r.status_code == 422
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_file", "file")
    assert error["error_count"] >= 1
    assert error["errors"][0]["line"] == line
    assert fragment in error["errors"][0]["message"]
    assert count_rows(File) == 0


def test_upload_reports_every_bad_line(client: TestClient, tenant: TenantKey) -> None:
    good = _line({"messages": [USER, ASSISTANT]})
    content = "\n".join([good, "oops", good, "{}", good]).encode()
    error = client.post("/v1/files", headers=tenant.headers, files={"file": ("f.jsonl", content)}).json()["error"]
    assert error["error_count"] == 2
    assert [e["line"] for e in error["errors"]] == [2, 4]


def test_upload_larger_than_the_tenant_quota_is_413(client: TestClient) -> None:
    r = client.post("/v1/admin/tenants", json={"name": "small", "max_file_bytes": 100}, headers=ADMIN)
    key = client.post(f"/v1/admin/tenants/{r.json()['id']}/api-keys", headers=ADMIN).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    r = client.post("/v1/files", headers=headers, files={"file": ("big.jsonl", chat_rows(10))})
    assert r.status_code == 413
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("file_too_large", "file")
    small = prompt_rows(1)
    assert len(small) <= 100
    assert client.post("/v1/files", headers=headers, files={"file": ("s.jsonl", small)}).status_code == 201


def test_upload_without_the_file_field_is_422(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/files", headers=tenant.headers, data={"purpose": "fine-tune"})
    assert r.status_code == 422
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("file", "missing_field")


def test_upload_with_an_unknown_purpose_is_422(client: TestClient, tenant: TenantKey) -> None:
    r = client.post("/v1/files", headers=tenant.headers, files={"file": ("a.jsonl", chat_rows(2))},
                    data={"purpose": "batch"})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "purpose"


def test_failed_insert_leaves_no_stored_content(
    clean_db: None, tenant: TenantKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.main import create_app

    def broken_commit(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("database went away")

    monkeypatch.setattr("api.services.files.commit", broken_commit)
    store = get_artifact_store()
    before = set((store.root / "files").glob("*")) if (store.root / "files").exists() else set()
    with TestClient(create_app(), raise_server_exceptions=False) as c:
        r = c.post("/v1/files", headers=tenant.headers, files={"file": ("a.jsonl", chat_rows(3))})
    assert r.status_code == 500
    assert set((store.root / "files").glob("*")) == before
    assert count_rows(File) == 0


def test_list_files_newest_first_with_cursor(client: TestClient, tenant: TenantKey) -> None:
    ids = [upload(client, tenant, chat_rows(2), f"f{i}.jsonl")["id"] for i in range(3)]
    page = client.get("/v1/files?limit=2", headers=tenant.headers).json()
    assert page["object"] == "list"
    assert [f["id"] for f in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
    rest = client.get(f"/v1/files?limit=2&after={ids[1]}", headers=tenant.headers).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    r = client.get("/v1/files?after=file-missing", headers=tenant.headers)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "after")


def test_get_and_delete_file(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    assert client.get(f"/v1/files/{file['id']}", headers=tenant.headers).json() == file
    r = client.delete(f"/v1/files/{file['id']}", headers=tenant.headers)
    assert r.status_code == 200
    assert r.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert not get_artifact_store().exists(file_key(file["id"]))
    assert client.get(f"/v1/files/{file['id']}", headers=tenant.headers).status_code == 404
    assert client.delete(f"/v1/files/{file['id']}", headers=tenant.headers).status_code == 404
    assert client.get("/v1/files", headers=tenant.headers).json()["data"] == []


def test_delete_file_in_use_is_409_until_the_task_finishes(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    task = make_task(client, tenant, file["id"])
    r = client.delete(f"/v1/files/{file['id']}", headers=tenant.headers)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "file_in_use"
    assert task["id"] in r.json()["error"]["message"]
    assert get_artifact_store().exists(file_key(file["id"]))

    assert client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers).status_code == 200
    assert client.delete(f"/v1/files/{file['id']}", headers=tenant.headers).status_code == 200


def test_deleted_file_cannot_start_a_task(client: TestClient, tenant: TenantKey) -> None:
    file = upload(client, tenant)
    client.delete(f"/v1/files/{file['id']}", headers=tenant.headers)
    r = client.post("/v1/tasks", headers=tenant.headers,
                    json={"base_model": "tiny-random-llama", "training_file": file["id"], "search_space": {}})
    assert r.status_code == 422
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_file", "training_file")


def test_control_characters_are_dropped_from_the_filename(client: TestClient, tenant: TenantKey) -> None:
    # Sent raw (httpx would percent-encode most of them): NUL would be a database error on Postgres, the
    # escape and the bell would reach whatever terminal lists the files.
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="x\x00y\x1b[31m\x07.jsonl"\r\n\r\n'
            + chat_rows(2) + b"\r\n--b--\r\n")
    r = client.post("/v1/files", headers={**tenant.headers, "Content-Type": "multipart/form-data; boundary=b"},
                    content=body)
    assert r.status_code == 201, r.text
    assert r.json()["filename"] == "xy[31m.jsonl"
