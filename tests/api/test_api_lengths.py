"""Length checks before anything runs: a `max_seq_len` that leaves rows without a target token is refused at
submission and in the dry run with the rows' numbers; one that only shortens rows is accepted with a warning event;
a file's lengths are counted once per model and kept.

The tiny model's tokenizer is byte level, so a chat row of a user turn of n bytes and the answer "ok" is, rendered
with its ChatML template: "<|im_start|>" "user\\n" (6 tokens), n, "<|im_end|>" "\\n" "<|im_start|>" "assistant\\n"
(13): a prompt of n + 19 tokens, then "ok" "<|im_end|>" "\\n" (4) as the target. A row is n + 23 tokens long and
keeps a target token at max_seq_len n + 20 or more.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from common.db import session_scope
from common.tables import Event, FileTokenLengths, Task
from tests.factories import TenantKey, count_rows, task_body, upload

USER_BYTES = [40 + 10 * i for i in range(10)]  # rows of 63, 73, ..., 153 tokens; they need 60, 70, ..., 150


def long_rows() -> bytes:
    rows = [{"messages": [{"role": "user", "content": "q" * n}, {"role": "assistant", "content": "ok"}]}
            for n in USER_BYTES]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def body(file_id: str, max_seq_len: int) -> dict:
    return task_body(file_id, max_seq_len=max_seq_len, validation_split=0.2)


def assert_refused(r: Any, file_id: str) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "rows_truncated", "max_seq_len")
    # 64 keeps a target token only in the row of 40 user bytes (it needs 60); the other 9 lose theirs.
    assert (error["rows_without_target"], error["rows_counted"], error["file"]) == (9, 10, file_id)
    assert (error["length_p50"], error["length_p90"], error["length_max"]) == (103, 143, 153)
    assert error["suggested_max_seq_len"] == 150
    message = error["message"]
    for words in ("max_seq_len 64 leaves 9 row(s) of training_file", "p50 103, p90 143, max 153 tokens",
                  "Give max_seq_len 150 or more", "153 truncates none"):
        assert words in message, message


def test_a_max_seq_len_that_leaves_rows_without_a_target_is_refused_with_their_numbers(
    client: TestClient, tenant: TenantKey
) -> None:
    file_id = upload(client, tenant, long_rows())["id"]
    assert_refused(client.post("/v1/tasks?dry_run=true", json=body(file_id, 64), headers=tenant.headers), file_id)
    assert_refused(client.post("/v1/tasks", json=body(file_id, 64), headers=tenant.headers), file_id)
    assert count_rows(Task) == 0


def test_a_validation_files_rows_are_checked_too(client: TestClient, tenant: TenantKey) -> None:
    short = upload(client, tenant, json.dumps({"prompt": "p", "completion": "c"}).encode() + b"\n")["id"]
    long = upload(client, tenant, long_rows())["id"]
    r = client.post("/v1/tasks?dry_run=true", headers=tenant.headers,
                    json=task_body(short, validation_file=long, max_seq_len=64))
    assert r.status_code == 422 and r.json()["error"]["file"] == long, r.text
    assert "of validation_file" in r.json()["error"]["message"]


def test_a_max_seq_len_that_shortens_rows_is_accepted_with_a_warning_event(
    client: TestClient, tenant: TenantKey
) -> None:
    file_id = upload(client, tenant, long_rows())["id"]
    dry = client.post("/v1/tasks?dry_run=true", json=body(file_id, 150), headers=tenant.headers)
    assert dry.status_code == 200, dry.text
    r = client.post("/v1/tasks", json=body(file_id, 150), headers=tenant.headers)
    assert r.status_code == 201, r.text
    events = client.get(f"/v1/tasks/{r.json()['id']}/events", headers=tenant.headers).json()["data"]
    warnings = [e for e in events if e["type"] == "task.rows_truncated"]
    assert len(warnings) == 1, events
    assert warnings[0]["level"] == "warning"
    assert warnings[0]["data"] == {"file": file_id, "field": "training_file", "rows_shortened": 1, "rows_counted": 10,
                                   "length_p50": 103, "length_p90": 143, "length_max": 153}
    assert "shortens 1 of 10 rows" in warnings[0]["message"]


def test_a_max_seq_len_that_fits_every_row_is_accepted_without_a_warning(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant, long_rows())["id"]
    r = client.post("/v1/tasks", json=body(file_id, 153), headers=tenant.headers)
    assert r.status_code == 201, r.text
    types = [e["type"] for e in client.get(f"/v1/tasks/{r.json()['id']}/events", headers=tenant.headers).json()["data"]]
    assert "task.created" in types and "task.rows_truncated" not in types


def test_a_files_lengths_are_counted_once_per_model_and_kept(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant, long_rows())["id"]
    assert client.post("/v1/tasks?dry_run=true", json=body(file_id, 64), headers=tenant.headers).status_code == 422
    with session_scope() as session:  # the dry run wrote no task, but kept the lengths it counted
        stored = session.scalars(select(FileTokenLengths).where(FileTokenLengths.file_id == file_id)).all()
        assert [(s.base_model, s.lengths["counted"], s.lengths["total"]) for s in stored] == [
            ("tiny-random-llama", 10, 10)]
        # The next submission reads them: stored lengths that say every row fits make 64 acceptable.
        session.execute(update(FileTokenLengths).where(FileTokenLengths.file_id == file_id).values(
            lengths={"counted": 10, "total": 10, "tokens": [[30, 10]], "needed": [[20, 10]]}))
    r = client.post("/v1/tasks", json=body(file_id, 64), headers=tenant.headers)
    assert r.status_code == 201, r.text
    with session_scope() as session:
        assert session.scalar(select(Event.id).where(Event.type == "task.rows_truncated")) is None
    assert count_rows(FileTokenLengths) == 1
