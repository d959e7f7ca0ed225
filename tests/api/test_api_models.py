from __future__ import annotations

from fastapi.testclient import TestClient

from tests.factories import TenantKey


def test_list_models_shows_the_registry(client: TestClient, tenant: TenantKey) -> None:
    r = client.get("/v1/models", headers=tenant.headers)
    assert r.status_code == 200
    models = {m["id"]: m for m in r.json()["data"]}
    assert {"tiny-random-llama", "smollm2-135m-instruct"} <= set(models)
    smol = models["smollm2-135m-instruct"]
    assert (smol["object"], smol["kind"], smol["parameters"]) == ("model", "gguf-package", 134_515_008)
    assert set(smol) == {"id", "object", "kind", "description", "parameters", "architecture", "max_context",
                         "target_modules", "chat_template", "quantization"}
    # The built-ins say what tasks are checked against: both are Llamas with a chat template.
    llama_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (smol["architecture"], smol["max_context"], smol["target_modules"], smol["chat_template"]) == (
        "llama", 8192, llama_targets, True)
    tiny = models["tiny-random-llama"]
    assert (tiny["architecture"], tiny["max_context"], tiny["target_modules"], tiny["chat_template"]) == (
        "llama", 2048, llama_targets, True)


def test_get_model_by_name(client: TestClient, tenant: TenantKey) -> None:
    r = client.get("/v1/models/tiny-random-llama", headers=tenant.headers)
    assert (r.status_code, r.json()["id"]) == (200, "tiny-random-llama")
    r = client.get("/v1/models/org/unknown-model", headers=tenant.headers)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_models_need_an_api_key(client: TestClient) -> None:
    assert client.get("/v1/models").status_code == 401
