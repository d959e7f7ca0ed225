"""Merged export through the real service (issue 35): `GET .../adapter?format=merged` on `loraplane up` answers 202
while its CPU worker builds the merged model, then the archive; `transformers` loads it, and its logits equal the base
model's with the downloaded PEFT adapter. Another tenant's trial is a 404 and an unknown format a 422, each in the
one error shape."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import httpx
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from common.registry import DEFAULT_MODELS
from tests.conftest import MODEL_CACHE
from tests.e2e.flow import (
    arithmetic_rows,
    download_adapter,
    follow_events,
    grid_task,
    submit,
    tenant_client,
    upload,
    wait_for,
)
from tests.e2e.procs import EMBEDDED_UNSET, cluster, free_port, start_embedded
from worker.engine import load_base_model
from worker.model_cache import model_source

BUILD_CEILING_S = 600  # a merge of the tiny model takes seconds; a loaded 2-core machine may queue it a while


def base_and_adapter_logits(adapter_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    definition = next(d for d in DEFAULT_MODELS if d.name == "tiny-random-llama")
    source = model_source({"name": definition.name, "kind": definition.kind, "path": definition.path,
                           "package": definition.package, "gguf_file": definition.gguf_file})
    model, _ = load_base_model(source, cache_dir=MODEL_CACHE, device=torch.device("cpu"))
    with torch.no_grad():
        return PeftModel.from_pretrained(model, str(adapter_dir))(input_ids=input_ids).logits


def test_the_merged_model_is_built_once_on_a_worker_and_equals_base_plus_adapter(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in EMBEDDED_UNSET}
    env.update({"LORAPLANE_HOME": str(tmp_path / "home"), "LORAPLANE_SCHEDULER_TICK_S": "0.5",
                "LORAPLANE_HEARTBEAT_S": "1"})
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with cluster(env, tmp_path) as c:
        _, token = start_embedded(c, port)
        with tenant_client(base_url, token, "team-export") as lp, tenant_client(base_url, token, "team-other") as other:
            task = submit(lp, grid_task(upload(lp, arithmetic_rows())))
            _, ended = follow_events(lp, task.id)
            assert ended.state == "succeeded" and ended.best_trial is not None
            url = f"{base_url}/v1/tasks/{task.id}/adapter?format=merged"
            mine = {"Authorization": f"Bearer {lp.api_key}"}

            first = httpx.get(url, headers=mine, timeout=30)
            assert first.status_code == 202 and first.headers["Retry-After"] == "5", first.text
            assert first.json()["status"] == "building"
            leak = httpx.get(f"{base_url}/v1/tasks/{task.id}/trials/{ended.best_trial.id}/adapter?format=merged",
                             headers={"Authorization": f"Bearer {other.api_key}"}, timeout=30)
            assert leak.status_code == 404 and leak.json()["error"]["code"] == "task_not_found", leak.text
            bad = httpx.get(f"{base_url}/v1/tasks/{task.id}/adapter?format=gguf-please", headers=mine, timeout=30)
            assert bad.status_code == 422 and "merged" in bad.json()["error"]["message"], bad.text

            def built() -> httpx.Response | None:
                r = httpx.get(url, headers=mine, timeout=60)
                assert r.status_code in (200, 202), r.text  # a failed build would be a 409 export_failed
                return r if r.status_code == 200 else None

            merged = wait_for(built, BUILD_CEILING_S, "the merged model", interval_s=1.0)
            adapter = download_adapter(lp, task.id, tmp_path / "adapter")
            # The client waits out another trial's build itself (202s and Retry-After).
            runner_up = next(t for t in lp.tasks.trials(task.id).data if t.id != ended.best_trial.id)
            by_client = lp.tasks.download_adapter(task.id, tmp_path / "runner-up", trial_id=runner_up.id, merged=True,
                                                  timeout=BUILD_CEILING_S)
            assert {"config.json", "model.safetensors"} <= {p.name for p in by_client.iterdir()}
    merged_dir = tmp_path / "merged"
    with tarfile.open(fileobj=io.BytesIO(merged.content), mode="r:gz") as tar:
        tar.extractall(merged_dir, filter="data")
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged in: a plain model
    input_ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        got = model(input_ids=input_ids).logits
    want = base_and_adapter_logits(adapter, input_ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
