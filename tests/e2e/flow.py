"""The user's journey through the public API, shared by the distributed and the embedded end-to-end tests."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx


def arithmetic_rows(n: int = 32) -> bytes:
    """A small learnable dataset: prompt/completion additions (the completion is the only target)."""
    rows = [{"prompt": f"{a} plus {a + 1} is", "completion": f" {2 * a + 1}"} for a in range(n)]
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


def create_tenant_key(base_url: str, admin_token: str, name: str) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {admin_token}"}
    tenant = httpx.post(f"{base_url}/v1/admin/tenants", json={"name": name}, headers=admin, timeout=10)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(f"{base_url}/v1/admin/tenants/{tenant.json()['id']}/api-keys", json={"name": "ci"},
                     headers=admin, timeout=10)
    assert key.status_code == 201, key.text
    return {"Authorization": f"Bearer {key.json()['key']}"}


def upload(base_url: str, headers: dict[str, str], data: bytes, filename: str = "train.jsonl") -> str:
    r = httpx.post(f"{base_url}/v1/files", headers=headers, files={"file": (filename, data, "application/jsonl")},
                   timeout=30)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def submit(base_url: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/v1/tasks", headers=headers, json=body, timeout=30)
    assert r.status_code == 201, r.text
    return dict(r.json())


def grid_task(file_id: str, base_model: str = "tiny-random-llama", max_steps: int = 6) -> dict[str, Any]:
    return {
        "base_model": base_model,
        "training_file": file_id,
        "validation_split": 0.2,
        "search_space": {"learning_rate": [1e-3, 5e-3], "lora_rank": [2, 4], "batch_size": [4],
                         "target_modules": [["q_proj", "v_proj"]]},
        "strategy": "grid",
        "max_steps": max_steps,
        "max_seq_len": 64,
        "eval_interval": 3,
        "seed": 7,
    }


def follow_events(base_url: str, headers: dict[str, str], task_id: str, timeout_s: float) -> list[dict[str, Any]]:
    """Reads the SSE stream to its `end` event; returns the events (with their SSE event names)."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    with httpx.stream("GET", f"{base_url}/v1/tasks/{task_id}/events/stream", headers=headers,
                      timeout=httpx.Timeout(timeout_s, connect=10)) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no end event after {timeout_s}s; got {[e.get('event') for e in events]}")
            if line.startswith(":"):
                continue
            if not line:
                if current:
                    events.append(current)
                    if current.get("event") == "end":
                        return events
                current = {}
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            current[field] = json.loads(value) if field == "data" else value
    raise AssertionError(f"stream closed without an end event: {events}")


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


def download_adapter(base_url: str, headers: dict[str, str], path: str, into: Path) -> Path:
    r = httpx.get(f"{base_url}{path}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        tar.extractall(into, filter="data")
    assert {p.name for p in into.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    return into


def assert_adapter_changes_output(adapter_dir: Path, base_model: str, model_cache: Path) -> None:
    """The downloaded adapter loads with PEFT on a fresh base model and changes its logits."""
    import torch
    from peft import PeftModel

    from common.registry import DEFAULT_MODELS
    from worker.engine import ModelSource, load_base_model

    definition = next(d for d in DEFAULT_MODELS if d.name == base_model)
    source = ModelSource(name=definition.name, kind=definition.kind, path=definition.path,
                         package=definition.package, gguf_file=definition.gguf_file)
    model, tokenizer = load_base_model(source, cache_dir=model_cache, device=torch.device("cpu"))
    inputs = tokenizer("3 plus 4 is", return_tensors="pt")
    with torch.no_grad():
        base_logits = model(**inputs).logits.clone()
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
        tuned_logits = peft_model(**inputs).logits
    assert (tuned_logits - base_logits).abs().max().item() > 1e-4
