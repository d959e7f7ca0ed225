"""The operator's model registry (admin token): register a real model directory, who may use it, retiring it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.registry import model_source_fields
from common.tables import BaseModelEntry, Task
from scheduler.service.cluster_state import load_costs
from tests.common.gguf_files import llama_gguf
from tests.factories import ADMIN, TenantKey, count_rows, make_task, prompt_rows, task_body, update_row, upload
from tests.model_dirs import copy_without, with_config

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_register_and_list(client: TestClient, tenant: TenantKey, tiny_model_dir: Path) -> None:
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "acme/llama-tiny", "path": str(tiny_model_dir), "description": "ours"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["kind"], body["path"], body["description"]) == (
        "acme/llama-tiny", "hf", str(tiny_model_dir), "ours")
    assert (body["architecture"], body["max_context"], body["target_modules"], body["tenants"]) == (
        "llama", 2048, LLAMA_TARGETS, None)
    assert (body["chat_template"], body["deleted_at"]) == (True, None)
    assert body["parameters"] == 107_200  # the tiny Llama's (2 layers of 64 wide, 259-token vocabulary, untied)
    assert body["created_at"].endswith("Z")

    listed = client.get("/v1/admin/models", headers=ADMIN).json()["data"]
    assert {"acme/llama-tiny", "tiny-random-llama", "smollm2-135m-instruct"} <= {m["name"] for m in listed}
    assert client.get("/v1/admin/models/acme/llama-tiny", headers=ADMIN).json() == body

    seen = client.get("/v1/models/acme/llama-tiny", headers=tenant.headers).json()
    assert (seen["id"], seen["architecture"], seen["max_context"], seen["target_modules"], seen["chat_template"]) == (
        "acme/llama-tiny", "llama", 2048, LLAMA_TARGETS, True)
    assert "path" not in seen and "tenants" not in seen  # where it lives and who else may use it are the operator's
    make_task(client, tenant, base_model="acme/llama-tiny")  # and a task can be submitted for it


def test_duplicate_name_is_409(client: TestClient, tiny_model_dir: Path) -> None:
    assert client.post("/v1/admin/models", json={"name": "mine", "path": str(tiny_model_dir)},
                       headers=ADMIN).status_code == 201
    r = client.post("/v1/admin/models", json={"name": "mine", "path": str(tiny_model_dir)}, headers=ADMIN)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "model_exists"
    r = client.post("/v1/admin/models", json={"name": "tiny-random-llama", "path": str(tiny_model_dir)}, headers=ADMIN)
    assert r.status_code == 409  # the built-ins too


@pytest.mark.parametrize(
    ("case", "code", "words"),
    [
        ("missing", "model_path_not_found", "does not exist"),
        ("file", "model_path_not_a_directory", "not a directory"),
        ("no_config", "model_config_missing", "no config.json"),
        ("bad_json", "model_config_invalid", "not readable JSON"),
        ("unsupported", "unsupported_architecture", "model_type 'gpt2'"),
        ("no_weights", "model_weights_missing", "safetensors"),
        ("no_tokenizer", "model_tokenizer_missing", "no tokenizer"),
    ],
)
def test_a_directory_that_cannot_be_registered_is_422(
    client: TestClient, tiny_model_dir: Path, tmp_path: Path, case: str, code: str, words: str
) -> None:
    target = tmp_path / "model"
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "file":
        path = tiny_model_dir / "config.json"
    elif case == "no_config":
        path = copy_without(tiny_model_dir, target, "config.json")
    elif case == "bad_json":
        path = copy_without(tiny_model_dir, target)
        (path / "config.json").write_text("{not json")
    elif case == "unsupported":
        path = with_config(tiny_model_dir, target, model_type="gpt2")
    elif case == "no_weights":
        path = copy_without(tiny_model_dir, target, "model.safetensors")
    else:
        path = copy_without(tiny_model_dir, target, "tokenizer.json")
    r = client.post("/v1/admin/models", json={"name": "broken", "path": str(path)}, headers=ADMIN)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, "path")
    assert words in error["message"]
    if case == "unsupported":
        assert "llama, mistral, phi3, qwen2, qwen3" in error["message"]  # the supported ones are listed
    assert client.get("/v1/admin/models/broken", headers=ADMIN).status_code == 404  # nothing was stored


def test_unknown_tenant_and_bad_names_are_422(client: TestClient, tenant: TenantKey, tiny_model_dir: Path) -> None:
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "m", "path": str(tiny_model_dir), "tenants": [tenant.id, "tenant-nope"]})
    assert r.status_code == 422
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("unknown_tenant", "tenants[1]")
    assert "tenant-nope" in r.json()["error"]["message"]
    for name in ("", "/lead", "a//b", "has space", "x" * 101):
        r = client.post("/v1/admin/models", json={"name": name, "path": str(tiny_model_dir)}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (422, "name"), name


def test_gguf_needs_an_existing_file(client: TestClient, tmp_path: Path) -> None:
    r = client.post("/v1/admin/models", json={"name": "g", "path": str(tmp_path), "kind": "gguf"}, headers=ADMIN)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "file")
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "g", "path": str(tmp_path), "kind": "gguf", "file": "m.gguf"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "model_file_not_found")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "g", "path": str(tmp_path), "kind": "gguf", "file": "m.gguf"})
    assert r.status_code == 201, r.text
    # A header that cannot be read (here: the magic alone) says nothing: each field is unknown, null.
    assert (r.json()["kind"], r.json()["file"], r.json()["architecture"], r.json()["chat_template"]) == (
        "gguf", "m.gguf", None, None)


def test_a_gguf_file_is_described_by_its_header(client: TestClient, tenant: TenantKey, tmp_path: Path) -> None:
    llama_gguf(tmp_path / "chat.gguf", context=4096)
    llama_gguf(tmp_path / "plain.gguf", chat_template=False)
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "g", "path": str(tmp_path), "kind": "gguf", "file": "chat.gguf"})
    assert r.status_code == 201, r.text
    assert (r.json()["architecture"], r.json()["max_context"], r.json()["target_modules"],
            r.json()["chat_template"]) == ("llama", 4096, LLAMA_TARGETS, True)
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "p", "path": str(tmp_path), "kind": "gguf", "file": "plain.gguf"})
    assert (r.status_code, r.json()["chat_template"]) == (201, False)

    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04")
    llama_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    for file, code in (("zip.gguf", "model_file_invalid"), ("gpt2.gguf", "unsupported_architecture")):
        r = client.post("/v1/admin/models", headers=ADMIN,
                        json={"name": "bad", "path": str(tmp_path), "kind": "gguf", "file": file})
        assert r.status_code == 422, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, "file")
    assert client.get("/v1/admin/models/bad", headers=ADMIN).status_code == 404


def test_restricted_model_is_hidden_from_other_tenants(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey, tiny_model_dir: Path
) -> None:
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "private", "path": str(tiny_model_dir), "tenants": [tenant.id]})
    assert r.status_code == 201, r.text
    assert r.json()["tenants"] == [tenant.id]

    assert "private" in {m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    assert "private" not in {m["id"] for m in client.get("/v1/models", headers=other_tenant.headers).json()["data"]}
    hidden = client.get("/v1/models/private", headers=other_tenant.headers)
    unknown = client.get("/v1/models/no-such-model", headers=other_tenant.headers)
    assert (hidden.status_code, hidden.json()["error"]["code"]) == (404, "model_not_found")
    assert hidden.json()["error"]["message"] == unknown.json()["error"]["message"].replace("no-such-model", "private")

    make_task(client, tenant, base_model="private")
    file_id = upload(client, other_tenant)["id"]
    refused = client.post("/v1/tasks", headers=other_tenant.headers, json=task_body(file_id, base_model="private"))
    unknown = client.post("/v1/tasks", headers=other_tenant.headers, json=task_body(file_id, base_model="nope"))
    assert refused.status_code == unknown.status_code == 422
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "unknown_model"
    assert refused.json()["error"]["message"] == unknown.json()["error"]["message"].replace("nope", "private")

    # Opening it to everyone (tenants null) shows it to the other tenant too.
    r = client.patch("/v1/admin/models/private", json={"tenants": None, "description": "open"}, headers=ADMIN)
    assert (r.status_code, r.json()["tenants"], r.json()["description"]) == (200, None, "open")
    assert r.json()["updated_at"].endswith("Z")
    assert client.get("/v1/models/private", headers=other_tenant.headers).status_code == 200


def test_delete_is_refused_while_a_queued_task_uses_the_model_and_retires_it_after(
    client: TestClient, tenant: TenantKey, tiny_model_dir: Path
) -> None:
    assert client.post("/v1/admin/models", json={"name": "busy", "path": str(tiny_model_dir)},
                       headers=ADMIN).status_code == 201
    assert client.post("/v1/admin/models", json={"name": "idle", "path": str(tiny_model_dir)},
                       headers=ADMIN).status_code == 201
    task = make_task(client, tenant, base_model="busy")
    assert task["state"] == "queued"

    r = client.delete("/v1/admin/models/busy", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (409, "conflict_error",
                                                                                     "model_in_use")
    assert client.get("/v1/admin/models/busy", headers=ADMIN).json()["deleted_at"] is None  # nothing lost

    # Once cancelled the task no longer uses it: the model is retired, and the task still names it.
    assert client.post(f"/v1/tasks/{task['id']}/cancel", headers=tenant.headers).status_code == 200
    r = client.delete("/v1/admin/models/busy", headers=ADMIN)
    assert (r.status_code, r.content) == (204, b"")
    assert client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()["base_model"] == "busy"

    r = client.delete("/v1/admin/models/idle", headers=ADMIN)  # one no task ever named: retired alike
    assert (r.status_code, r.content) == (204, b"")
    for name in ("busy", "idle"):
        missing = client.get(f"/v1/admin/models/{name}", headers=ADMIN)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
        assert client.delete(f"/v1/admin/models/{name}", headers=ADMIN).status_code == 404
        assert client.patch(f"/v1/admin/models/{name}", json={}, headers=ADMIN).status_code == 404
        assert client.get(f"/v1/models/{name}", headers=tenant.headers).status_code == 404
    assert not {"busy", "idle"} & {m["name"] for m in client.get("/v1/admin/models", headers=ADMIN).json()["data"]}
    assert not {"busy", "idle"} & {m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    retired = {m["name"]: m for m in client.get("/v1/admin/models?include_deleted=true",
                                                headers=ADMIN).json()["data"]}
    assert retired["busy"]["deleted_at"].endswith("Z") and retired["tiny-random-llama"]["deleted_at"] is None

    # A retired model reads as unknown to task submission, exactly like a name never registered.
    file_id = upload(client, tenant)["id"]
    refused = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, base_model="busy"))
    unknown = client.post("/v1/tasks", headers=tenant.headers, json=task_body(file_id, base_model="nope"))
    assert refused.status_code == unknown.status_code == 422
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "unknown_model"
    assert refused.json()["error"]["message"] == unknown.json()["error"]["message"].replace("nope", "busy")
    assert count_rows(Task) == 1


def test_a_retired_name_can_be_registered_again(
    client: TestClient, tenant: TenantKey, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "acme/m", "path": str(tiny_model_dir), "tenants": [tenant.id]})
    assert r.status_code == 201, r.text
    old = make_task(client, tenant, base_model="acme/m")
    assert client.post(f"/v1/tasks/{old['id']}/cancel", headers=tenant.headers).status_code == 200
    assert client.delete("/v1/admin/models/acme/m", headers=ADMIN).status_code == 204

    plain = copy_without(tiny_model_dir, tmp_path / "plain", "chat_template.jinja")
    r = client.post("/v1/admin/models", headers=ADMIN,
                    json={"name": "acme/m", "path": str(plain), "description": "second"})
    assert r.status_code == 201, r.text
    body = r.json()
    # The new entry replaces the retired one entirely: its path, description, tenants (every one), files.
    assert (body["path"], body["description"], body["tenants"], body["chat_template"], body["deleted_at"],
            body["updated_at"]) == (str(plain), "second", None, False, None, None)
    assert client.get("/v1/admin/models/acme/m", headers=ADMIN).json() == body
    assert client.get("/v1/models/acme/m", headers=tenant.headers).status_code == 200
    make_task(client, tenant, upload(client, tenant, prompt_rows())["id"], base_model="acme/m")
    # And a second registration of the name, now live again, is the usual 409.
    r = client.post("/v1/admin/models", headers=ADMIN, json={"name": "acme/m", "path": str(plain)})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "model_exists")


def test_a_refused_re_registration_keeps_the_retired_entry(client: TestClient, tmp_path: Path,
                                                           tiny_model_dir: Path) -> None:
    assert client.post("/v1/admin/models", json={"name": "m", "path": str(tiny_model_dir)},
                       headers=ADMIN).status_code == 201
    assert client.delete("/v1/admin/models/m", headers=ADMIN).status_code == 204
    r = client.post("/v1/admin/models", json={"name": "m", "path": str(tmp_path / "nowhere")}, headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "model_path_not_found")
    assert client.get("/v1/admin/models/m", headers=ADMIN).status_code == 404
    retired = [m for m in client.get("/v1/admin/models?include_deleted=true", headers=ADMIN).json()["data"]
               if m["name"] == "m"]
    assert retired[0]["path"] == str(tiny_model_dir) and retired[0]["deleted_at"] is not None


def test_a_built_in_model_can_be_retired_and_stays_retired(client: TestClient, tenant: TenantKey) -> None:
    from api.main import create_app
    from common.db import session_scope
    from common.registry import ensure_default_models

    assert client.delete("/v1/admin/models/tiny-random-llama", headers=ADMIN).status_code == 204
    with session_scope() as session:
        ensure_default_models(session)
    with TestClient(create_app()) as restarted:  # the API's start seeds the registry again
        assert restarted.get("/v1/admin/models/tiny-random-llama", headers=ADMIN).status_code == 404
        names = {m["id"] for m in restarted.get("/v1/models", headers=tenant.headers).json()["data"]}
    assert names == {"smollm2-135m-instruct"}


def test_seeding_fills_the_built_ins_missing_fields_but_keeps_an_operators(client: TestClient) -> None:
    from common.db import session_scope
    from common.registry import ensure_default_models
    from common.tables import BaseModelEntry

    # A registry seeded before these fields existed, where an operator has since set tiny-random-llama's context.
    update_row(BaseModelEntry, "smollm2-135m-instruct", architecture=None, max_context=None, chat_template=None)
    update_row(BaseModelEntry, "tiny-random-llama", max_context=1024, chat_template=False)
    with session_scope() as session:
        ensure_default_models(session)
    models = {m["name"]: m for m in client.get("/v1/admin/models", headers=ADMIN).json()["data"]}
    smol, tiny = models["smollm2-135m-instruct"], models["tiny-random-llama"]
    assert (smol["architecture"], smol["max_context"], smol["chat_template"]) == ("llama", 8192, True)
    assert (tiny["architecture"], tiny["max_context"], tiny["chat_template"]) == ("llama", 1024, False)


def test_patch_reads_the_files_again(client: TestClient, tiny_model_dir: Path, tmp_path: Path) -> None:
    path = copy_without(tiny_model_dir, tmp_path / "m", "chat_template.jinja")
    r = client.post("/v1/admin/models", json={"name": "m", "path": str(path), "description": "d"}, headers=ADMIN)
    assert (r.status_code, r.json()["chat_template"]) == (201, False)

    (path / "chat_template.jinja").write_text((tiny_model_dir / "chat_template.jinja").read_text())
    r = client.patch("/v1/admin/models/m", json={}, headers=ADMIN)
    assert (r.status_code, r.json()["chat_template"], r.json()["description"]) == (200, True, "d")

    (path / "config.json").unlink()
    r = client.patch("/v1/admin/models/m", json={"description": "new"}, headers=ADMIN)
    assert r.status_code == 422
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("model_config_missing", "path")
    stored = client.get("/v1/admin/models/m", headers=ADMIN).json()
    assert (stored["description"], stored["chat_template"], stored["architecture"]) == ("d", True, "llama")


def test_model_routes_need_the_admin_token(client: TestClient, tenant: TenantKey, tiny_model_dir: Path) -> None:
    r = client.post("/v1/admin/models", json={"name": "m", "path": str(tiny_model_dir)}, headers=tenant.headers)
    assert r.status_code == 403
    assert client.get("/v1/admin/models").status_code == 401


def test_a_retired_built_in_is_restored_and_tasks_can_use_it_again(client: TestClient, tenant: TenantKey) -> None:
    from api.main import create_app
    from common.bus import REGISTRY_KEY, get_bus
    from common.celery import get_celery
    from common.settings import get_settings
    from scheduler.service.daemon import SchedulerDaemon

    daemon = SchedulerDaemon(get_settings(), get_bus(), get_celery(), consumer="test")
    file_id = upload(client, tenant)["id"]
    assert client.delete("/v1/admin/models/tiny-random-llama", headers=ADMIN).status_code == 204
    refused = client.post("/v1/tasks?dry_run=true", headers=tenant.headers, json=task_body(file_id))
    assert (refused.status_code, refused.json()["error"]["code"]) == (422, "unknown_model")
    daemon.step(block_s=0.05)
    published = get_bus().get(REGISTRY_KEY)
    assert published is not None and "tiny-random-llama" not in published["models"]

    r = client.post("/v1/admin/models/tiny-random-llama/restore", headers=ADMIN)
    assert r.status_code == 200, r.text
    restored = r.json()
    assert (restored["name"], restored["kind"], restored["deleted_at"]) == ("tiny-random-llama", "tiny-random-llama",
                                                                            None)
    assert restored["updated_at"].endswith("Z") and restored["architecture"] == "llama"
    assert client.get("/v1/admin/models/tiny-random-llama", headers=ADMIN).json() == restored
    assert "tiny-random-llama" in {m["id"] for m in client.get("/v1/models", headers=tenant.headers).json()["data"]}
    r = client.post("/v1/tasks?dry_run=true", headers=tenant.headers, json=task_body(file_id))
    assert r.status_code == 200, r.text
    # The scheduler publishes the changed registry at its next round, for the workers to load it again.
    daemon.step(block_s=0.05)
    published = get_bus().get(REGISTRY_KEY)
    assert published is not None and published["models"]["tiny-random-llama"]["kind"] == "tiny-random-llama"

    with TestClient(create_app()) as restarted:  # seeding at start leaves the restored entry as it is
        assert restarted.get("/v1/admin/models/tiny-random-llama", headers=ADMIN).json() == restored
    r = client.post("/v1/admin/models/tiny-random-llama/restore", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "model_exists")


def test_restore_is_404_for_an_unknown_name_and_409_while_a_live_model_holds_it(
    client: TestClient, tiny_model_dir: Path
) -> None:
    r = client.post("/v1/admin/models/nope/restore", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (404, "not_found_error",
                                                                                     "model_not_found")
    assert client.post("/v1/admin/models", json={"name": "m", "path": str(tiny_model_dir), "description": "first"},
                       headers=ADMIN).status_code == 201
    r = client.post("/v1/admin/models/m/restore", headers=ADMIN)  # never retired
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (409, "conflict_error",
                                                                                     "model_exists")
    # Retired, then registered again: the new entry holds the name, and stays as registered.
    assert client.delete("/v1/admin/models/m", headers=ADMIN).status_code == 204
    again = client.post("/v1/admin/models", json={"name": "m", "path": str(tiny_model_dir), "description": "second"},
                        headers=ADMIN).json()
    r = client.post("/v1/admin/models/m/restore", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "model_exists")
    assert client.get("/v1/admin/models/m", headers=ADMIN).json() == again


def test_restore_checks_the_files_again_and_takes_names_with_slashes(
    client: TestClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = copy_without(tiny_model_dir, tmp_path / "m")
    assert client.post("/v1/admin/models", json={"name": "acme/m", "path": str(path)}, headers=ADMIN).status_code == 201
    assert client.delete("/v1/admin/models/acme/m", headers=ADMIN).status_code == 204

    # Its files are read as registration reads them: gone, the restore is a 422 naming why, and it stays retired.
    config = (path / "config.json").read_bytes()
    (path / "config.json").unlink()
    r = client.post("/v1/admin/models/acme/m/restore", headers=ADMIN)
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (422, "model_config_missing",
                                                                                     "path")
    assert client.get("/v1/admin/models/acme/m", headers=ADMIN).status_code == 404
    (path / "config.json").write_bytes(config)
    r = client.post("/v1/admin/models/acme/m/restore", headers=ADMIN)
    assert (r.status_code, r.json()["name"], r.json()["deleted_at"]) == (200, "acme/m", None)

    assert client.get("/v1/admin/models/acme/m", headers=ADMIN).json()["name"] == "acme/m"

    # `{name}/restore` is the action's path, POST only: the other methods are a 405 naming it, not calls on a model
    # named `acme/m/restore`, a name registration refuses.
    for method in ("GET", "PATCH", "DELETE"):
        r = client.request(method, "/v1/admin/models/acme/m/restore", headers=ADMIN, json={} if method == "PATCH"
                           else None)
        assert (r.status_code, r.json()["error"]["code"], r.headers["allow"]) == (405, "method_not_allowed",
                                                                                  "POST, OPTIONS"), method
    r = client.post("/v1/admin/models", json={"name": "x/restore", "path": str(tiny_model_dir)}, headers=ADMIN)
    assert (r.status_code, r.json()["error"]["param"]) == (422, "name")
    assert "may not end in '/restore'" in r.json()["error"]["message"]
    # A model named `restore` (no slash before it) is an ordinary name.
    assert client.post("/v1/admin/models", json={"name": "restore", "path": str(tiny_model_dir)},
                       headers=ADMIN).status_code == 201
    assert client.get("/v1/admin/models/restore", headers=ADMIN).json()["name"] == "restore"
    r = client.post("/v1/admin/models/x/restore", headers=ADMIN)  # restore of "x": no such model
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def test_a_model_registered_in_nf4_says_so_and_its_packs_load_it_so(client: TestClient, tenant: TenantKey,
                                                                    tiny_model_dir: Path) -> None:
    """The same directory registered twice, once held in 4 bits: each shows its quantization, a worker is told it
    with the model (common/registry.py `model_source_fields`: what a pack message carries), and the planner's prior
    for it counts 0.6 bytes a parameter; any other quantization is a 422."""
    r = client.post("/v1/admin/models", headers=ADMIN, json={"name": "acme/tiny-nf4", "path": str(tiny_model_dir),
                                                               "quantization": "nf4"})
    assert r.status_code == 201 and r.json()["quantization"] == "nf4", r.text
    plain = client.post("/v1/admin/models", headers=ADMIN, json={"name": "acme/tiny", "path": str(tiny_model_dir)})
    assert plain.json()["quantization"] is None
    assert client.get("/v1/models/acme/tiny-nf4", headers=tenant.headers).json()["quantization"] == "nf4"
    bad = client.post("/v1/admin/models", headers=ADMIN, json={"name": "acme/tiny-int3", "path": str(tiny_model_dir),
                                                                 "quantization": "int3"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "quantization", bad.text
    with session_scope() as session:
        entry = session.get_one(BaseModelEntry, "acme/tiny-nf4")
        assert model_source_fields(entry)["quantization"] == "nf4"
        costs = load_costs(session, ["acme/tiny-nf4", "acme/tiny"])
    assert costs["acme/tiny-nf4"].memory.k0_bytes == 0.6 * 107_200
    assert costs["acme/tiny"].memory.k0_bytes == 2 * 107_200
