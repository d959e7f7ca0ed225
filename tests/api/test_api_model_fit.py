"""A task is checked against its model's registry entry: target modules the model has ("all-linear" resolving to
all of them), max_seq_len within its context, chat rows only where its tokenizer has a chat template. Each refusal
is a 422 in the one error shape with its own code, and writes nothing."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from common.tables import BaseModelEntry, Task, Trial, utcnow
from tests.factories import ADMIN, TenantKey, count_rows, make_task, prompt_rows, task_body, upload
from tests.model_dirs import copy_without, with_config

LLAMA_TARGETS = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def _register(client: TestClient, name: str, path: Path) -> dict[str, Any]:
    r = client.post("/v1/admin/models", json={"name": name, "path": str(path)}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def phi3(client: TestClient, tiny_model_dir: Path, tmp_path: Path) -> str:
    """A registered model of model_type phi3 (fused projections); the registry reads only its config."""
    _register(client, "phi3-tiny", with_config(tiny_model_dir, tmp_path / "phi3", model_type="phi3"))
    return "phi3-tiny"


def _refused(client: TestClient, tenant: TenantKey, body: dict[str, Any], code: str, param: str) -> dict[str, Any]:
    before = (count_rows(Task), count_rows(Trial))
    r = client.post("/v1/tasks", headers=tenant.headers, json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert (count_rows(Task), count_rows(Trial)) == before  # nothing written
    return error


def test_target_modules_must_be_the_models(client: TestClient, tenant: TenantKey, phi3: str) -> None:
    file_id = upload(client, tenant)["id"]
    # phi3 has no q_proj: the choice that names it is refused, with the names it does have.
    error = _refused(client, tenant, task_body(file_id, base_model=phi3, search_space={
        "target_modules": [["qkv_proj"], ["q_proj", "v_proj"]]}), "unknown_target_module",
        "search_space.target_modules[1]")
    assert "no module q_proj, v_proj" in error["message"]
    assert "qkv_proj, o_proj, gate_up_proj, down_proj" in error["message"]
    # The default ("all-linear") fits every architecture: on Phi-3 it is the fused projections.
    default = make_task(client, tenant, file_id, base_model=phi3)
    assert default["search_space"]["target_modules"] == ["all-linear"]
    # Llama's are the split projections: the fused ones are refused there.
    error = _refused(client, tenant, task_body(file_id, search_space={"target_modules": [["q_proj", "gate_up_proj"]]}),
                     "unknown_target_module", "search_space.target_modules[0]")
    assert LLAMA_TARGETS in error["message"] and "gate_up_proj" in error["message"]

    task = make_task(client, tenant, file_id, base_model=phi3, search_space={
        "target_modules": [["gate_up_proj", "qkv_proj"], "all-linear"]})
    assert task["search_space"]["target_modules"] == [["qkv_proj", "gate_up_proj"], "all-linear"]
    task = make_task(client, tenant, file_id, base_model=phi3, search_space={"target_modules": "all-linear"})
    assert task["search_space"]["target_modules"] == ["all-linear"]


def test_target_modules_of_a_model_whose_architecture_is_unknown_are_not_checked(
    client: TestClient, tenant: TenantKey, tmp_path: Path
) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # a header that cannot be read: architecture unknown
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "g", "path": str(tmp_path), "kind": "gguf", "file": "m.gguf"})
    assert (r.status_code, r.json()["architecture"], r.json()["chat_template"]) == (201, None, None)
    # Any name of some architecture is taken, and chat rows are too (whether it has a chat template is unknown).
    make_task(client, tenant, base_model="g", search_space={"target_modules": [["qkv_proj"], ["q_proj"]]},
              max_seq_len=8192)


def test_max_seq_len_over_the_models_context_is_refused(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    error = _refused(client, tenant, task_body(file_id, max_seq_len=4096), "max_seq_len_over_context", "max_seq_len")
    assert "4096" in error["message"] and "at most 2048" in error["message"]  # tiny-random-llama: 2048
    assert make_task(client, tenant, file_id, max_seq_len=2048)["max_seq_len"] == 2048
    # smollm2-135m-instruct's context is 8192: the request's own ceiling.
    smol = make_task(client, tenant, file_id, base_model="smollm2-135m-instruct", max_seq_len=8192)
    assert smol["max_seq_len"] == 8192


def test_chat_rows_need_a_chat_template(
    client: TestClient, tenant: TenantKey, tiny_model_dir: Path, tmp_path: Path
) -> None:
    entry = _register(client, "plain", copy_without(tiny_model_dir, tmp_path / "plain", "chat_template.jinja"))
    assert entry["chat_template"] is False
    assert client.get("/v1/models/plain", headers=tenant.headers).json()["chat_template"] is False
    chat = upload(client, tenant)["id"]
    prompts = upload(client, tenant, prompt_rows(20))["id"]

    error = _refused(client, tenant, task_body(chat, base_model="plain"), "model_has_no_chat_template",
                     "training_file")
    assert f"'{chat}'" in error["message"] and "'plain' has no chat template" in error["message"]
    _refused(client, tenant, task_body(prompts, base_model="plain", validation_file=chat),
             "model_has_no_chat_template", "validation_file")

    make_task(client, tenant, prompts, base_model="plain")  # prompt/completion rows need no template
    make_task(client, tenant, chat)  # and chat rows are fine on a model that has one


def test_the_expansion_checks_the_model_and_says_what_all_linear_is(
    client: TestClient, tenant: TenantKey, phi3: str
) -> None:
    space = {"target_modules": [["qkv_proj"], "all-linear"]}
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers,
                    json={"base_model": phi3, "search_space": space})
    assert r.status_code == 200, r.text
    assert (r.json()["count"], r.json()["all_linear"]) == (2, PHI3_TARGETS)
    assert [t["target_modules"] for t in r.json()["trials"]] == [["qkv_proj"], "all-linear"]

    r = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={"search_space": space})
    assert (r.status_code, r.json()["all_linear"]) == (200, None)  # no model: nothing to resolve against

    r = client.post("/v1/search-spaces/expand", headers=tenant.headers,
                    json={"base_model": phi3, "search_space": {"target_modules": [["v_proj"]]}})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
        422, "unknown_target_module", "search_space.target_modules[0]")
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers,
                    json={"base_model": "nope", "search_space": space})
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
        422, "unknown_model", "base_model")


def test_a_submission_waits_for_a_retirement_in_progress_and_then_sees_it(
    client: TestClient, tenant: TenantKey
) -> None:
    """DELETE locks the entry (FOR UPDATE) while it checks for tasks; a submission locks it FOR SHARE, so it
    waits, then reads the model as retired: no task is queued on a retired model."""
    from common.db import session_scope

    file_id = upload(client, tenant)["id"]
    with session_scope() as session, ThreadPoolExecutor(1) as pool:
        entry = session.scalars(select(BaseModelEntry).where(BaseModelEntry.name == "tiny-random-llama")
                                .with_for_update()).one()
        submitted = pool.submit(client.post, "/v1/tasks", headers=tenant.headers, json=task_body(file_id))
        time.sleep(0.5)
        assert not submitted.done()  # waiting on the lock
        entry.deleted_at = utcnow()
        session.commit()
        r = submitted.result(timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "unknown_model")
    assert count_rows(Task) == 0
