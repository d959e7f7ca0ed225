"""Estimates before launch: `POST /v1/search-spaces/expand`, `POST /v1/tasks?dry_run=true`, the estimate a
submission stores, and the actual its task records when it ends."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import BaseModelEntry, Event, Pack, Task, Trial, TrialUsage, Worker, as_utc, utcnow
from scheduler.planning.cost import PRIOR_COST, ModelCost, fit_profiles, prior_cost, samples_from_profiles
from scheduler.planning.estimate import CPU_DEVICE_KIND, FITTED_BAND, PRIOR_BAND, TrialLoad, UsableWorker, estimate
from scheduler.service.task_results import finalize_tasks
from tests.factories import TenantKey, count_rows, make_tenant, prompt_rows, task_body, update_row, upload

MODEL = "tiny-random-llama"
SPACE = {"learning_rate": [1e-4, 3e-4], "lora_rank": [8, 16], "batch_size": [4]}


def body(file_id: str, **overrides: Any) -> dict[str, Any]:
    out = task_body(file_id, search_space=SPACE, max_steps=50, max_seq_len=128)
    del out["epochs"]  # max_steps instead
    return {**out, **overrides}


def add_worker(worker_id: str = "w1", device: str = "cuda:0", **fields: Any) -> None:
    with session_scope() as s:
        s.add(Worker(id=worker_id, queue=f"q.{worker_id}", device=device, state="alive", max_slots=32,
                     last_heartbeat=utcnow(), **fields))


def prior_estimate(trials: int, steps: int, tokens: int, gpus: list[UsableWorker]) -> dict[str, Any]:
    return estimate([TrialLoad(steps, tokens)] * trials, PRIOR_COST, gpus, max_trials_per_pack=32,
                    on_priors=True).as_dict()


def test_expand_has_an_estimate_only_with_a_model_and_a_training_file(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    for partial in ({}, {"base_model": MODEL}, {"training_file": file_id}):
        r = client.post("/v1/search-spaces/expand", json={"search_space": SPACE, **partial}, headers=tenant.headers)
        assert r.status_code == 200, r.text
        assert r.json()["estimate"] is None
    add_worker()
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={
        "search_space": SPACE, "base_model": MODEL, "training_file": file_id, "max_steps": 50, "max_seq_len": 128})
    assert r.status_code == 200, r.text
    # 4 trials x 50 steps x batch 4 x 128 tokens, on the priors (no profile), one free worker.
    assert r.json()["estimate"] == prior_estimate(4, 50, 4 * 128, [UsableWorker()])
    assert r.json()["estimate"]["tokens"] == 4 * 50 * 4 * 128
    # Its steps from epochs: the file's 10 rows, a quarter held out by the default rule (2 rows), 8 rows at batch 4:
    # 2 steps an epoch.
    r = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={
        "search_space": SPACE, "base_model": MODEL, "training_file": file_id, "epochs": 2, "max_seq_len": 128})
    assert r.json()["estimate"]["tokens"] == 4 * 4 * 4 * 128


def test_expand_refuses_a_budget_the_task_would_refuse(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    base = {"search_space": SPACE, "base_model": MODEL}
    for extra, param in (({"training_file": "file-missing"}, "training_file"),
                         ({"training_file": file_id, "max_seq_len": 4096}, "max_seq_len")):
        r = client.post("/v1/search-spaces/expand", json={**base, **extra}, headers=tenant.headers)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text


def test_a_dry_run_answers_the_task_and_its_estimate_and_writes_nothing(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    add_worker()
    before = {m.__name__: count_rows(m) for m in (Task, Trial, Event, TrialUsage)}
    r = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers)
    assert r.status_code == 200, r.text
    dry = r.json()
    assert dry["id"] is None and dry["state"] == "queued" and dry["trial_counts"]["pending"] == 4
    assert dry["estimate"] == {**prior_estimate(4, 50, 4 * 128, [UsableWorker()]), "actual": None}
    assert {m.__name__: count_rows(m) for m in (Task, Trial, Event, TrialUsage)} == before
    # The same request for real: the same task, with its estimate stored and shown.
    r = client.post("/v1/tasks", json=body(file_id), headers=tenant.headers)
    assert r.status_code == 201, r.text
    real = r.json()
    assert real["estimate"] == dry["estimate"]
    assert {k: v for k, v in real.items() if k not in ("id", "created_at")} == {
        k: v for k, v in dry.items() if k not in ("id", "created_at")}
    with session_scope() as s:
        stored = s.get(Task, real["id"])
        assert stored is not None and stored.estimate == {k: v for k, v in dry["estimate"].items() if k != "actual"}
    assert client.get(f"/v1/tasks/{real['id']}", headers=tenant.headers).json()["estimate"] == dry["estimate"]
    # A repeated Idempotency-Key in a dry run answers the earlier task, as a submission does.
    headers = {**tenant.headers, "Idempotency-Key": "k1"}
    first = client.post("/v1/tasks", json=body(file_id), headers=headers).json()
    again = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first["id"]


def refusals(file_id: str, other_file: str) -> list[dict[str, Any]]:
    return [
        body(file_id, base_model="no-such-model"),
        body("file-missing"),
        body(other_file),  # another tenant's file reads as missing
        body(file_id, epochs=1),  # epochs and max_steps
        body(file_id, max_seq_len=4096),  # over the model's context
        body(file_id, search_space={"lora_rank": [2, 4, 8, 16, 32, 64]}),  # over max_trials_per_task (4)
        body(file_id, strategy="random"),  # no max_trials
        body(file_id, search_space={"target_modules": [["no_proj"]]}),
        body(file_id, max_steps=0),
        body(file_id, search_space={"learning_rate": [1e-4, 2e-4, 3e-4]}, max_trials=2),
    ]


def test_every_refusal_of_a_submission_is_the_same_in_a_dry_run(client: TestClient) -> None:
    tenant = make_tenant(client, "small", max_trials_per_task=4, max_concurrent_trials=6)
    other = make_tenant(client, "other")
    file_id = upload(client, tenant)["id"]
    other_file = upload(client, other)["id"]
    tiny = upload(client, tenant, prompt_rows(1))["id"]  # one row: nothing to split off
    cases = [*refusals(file_id, other_file), body(tiny)]
    before = {m.__name__: count_rows(m) for m in (Task, Trial, Event)}
    for case in cases:
        real = client.post("/v1/tasks", json=case, headers=tenant.headers)
        dry = client.post("/v1/tasks?dry_run=true", json=case, headers=tenant.headers)
        assert real.status_code == dry.status_code and real.status_code in (404, 422), (case, real.text)
        assert real.json() == dry.json()
    assert {m.__name__: count_rows(m) for m in (Task, Trial, Event)} == before
    # The concurrency quota (429): 4 trials queued, 4 more would pass 6 at once.
    assert client.post("/v1/tasks", json=body(file_id), headers=tenant.headers).status_code == 201
    real = client.post("/v1/tasks", json=body(file_id), headers=tenant.headers)
    dry = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers)
    assert real.status_code == dry.status_code == 429 and real.json() == dry.json()


def test_the_estimate_of_a_model_larger_than_a_gpu_waits_for_a_worker_whose_gpus_hold_it(
        client: TestClient, tenant: TenantKey) -> None:
    """No pack has profiled the model: its prior holds its 140 GB of weights (the registry's parameter count), more
    than an 80 GB GPU; a worker over two 141 GB GPUs holds it."""
    with session_scope() as s:
        s.add(BaseModelEntry(name="llama-3.1-70b", kind="hf", path="/models/llama-3.1-70b", parameters=70_000_000_000,
                             architecture="llama", max_context=8192, chat_template=True))
    big = body(upload(client, tenant)["id"], base_model="llama-3.1-70b", max_seq_len=512)
    add_worker("w-h100", memory_bytes=80 * 10**9)

    def dry_run() -> dict[str, Any]:
        r = client.post("/v1/tasks?dry_run=true", json=big, headers=tenant.headers)
        assert r.status_code == 200, r.text
        return dict(r.json()["estimate"])

    assert dry_run()["wall_seconds"] is None  # no worker can hold it now
    add_worker("w-h200x2", memory_bytes=141 * 10**9, gpus=2)
    assert dry_run()["wall_seconds"] is not None


def test_the_estimate_uses_the_fitted_profile_and_the_busy_workers(client: TestClient, tenant: TenantKey) -> None:
    file_id = upload(client, tenant)["id"]
    add_worker("w1", memory_bytes=80 * 2**30)
    add_worker("w2", models=["some-other-model"])  # cannot load the model: not counted
    priors = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers).json()["estimate"]
    # A profiled pack of the model: the estimate is planned on its fit, no longer on the priors.
    profile = {"samples": [[4, 2048, 0, 0.05, 3 * 2**30], [8, 4096, 0, 0.09, 4 * 2**30], [2, 512, 0, 0.02, None]]}
    with session_scope() as s:
        s.add(Pack(id="pack-old", worker_id="w1", base_model=MODEL, state="finished", trial_ids=[], profile=profile,
                   created_at=utcnow()))
    memory, step = fit_profiles(samples_from_profiles([profile]))
    fitted = estimate([TrialLoad(50, 512)] * 4, ModelCost(memory, step, packs=1), [UsableWorker(80 * 2**30)],
                      max_trials_per_pack=32, on_priors=False).as_dict()
    got = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers).json()["estimate"]
    assert got == {**fitted, "actual": None} and got["gpu_seconds"] < priors["gpu_seconds"]
    # w1 busy with a running pack of 1,000 steps left: the task waits for it.
    task = client.post("/v1/tasks", json=body(file_id), headers=tenant.headers).json()
    with session_scope() as s:
        s.add(Pack(id="pack-busy", worker_id="w1", base_model=MODEL, state="running", trial_ids=[],
                   created_at=utcnow()))
        trial = s.query(Trial).filter_by(task_id=task["id"], index=0).one()
        trial.state, trial.pack_id, trial.total_steps = "running", "pack-busy", 1000
    busy = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers).json()["estimate"]
    wait = 1000 * step.predict(512, 1)
    assert busy["wall_seconds"] == pytest.approx(got["wall_seconds"] + wait, abs=0.2)


def test_a_finished_task_records_its_actual_beside_its_estimate(client: TestClient, tenant: TenantKey) -> None:
    task = client.post("/v1/tasks", json=body(upload(client, tenant)["id"]), headers=tenant.headers).json()
    trials = [t["id"] for t in client.get(f"/v1/tasks/{task['id']}/trials", headers=tenant.headers).json()["data"]]
    with session_scope() as s:
        created = as_utc(s.get(Task, task["id"]).created_at)  # type: ignore[union-attr]
    start = created + timedelta(seconds=5)
    with session_scope() as s:
        s.add(Pack(id="pack-1", worker_id="w1", base_model=MODEL, state="finished", trial_ids=trials,
                   created_at=start, started_at=start, finished_at=start + timedelta(seconds=40)))
        for i, trial_id in enumerate(trials):
            s.add(TrialUsage(pack_id="pack-1", trial_id=trial_id, task_id=task["id"], tenant_id=tenant.id,
                             tokens=1000 * (i + 1), steps=50, end_step=50))
    for trial_id in trials:
        update_row(Trial, trial_id, state="completed", adapter_key=f"adapters/{trial_id}.tar.gz", best_val_loss=1.0,
                   finished_at=start + timedelta(seconds=40))
    end = start + timedelta(seconds=45)
    with session_scope() as s:
        finalize_tasks(s, end)
    got = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()
    assert got["state"] == "succeeded"
    assert got["estimate"]["actual"] == {"tokens": 10_000, "gpu_seconds": 40.0, "wall_seconds": 50.0}
    assert {k: got["estimate"][k] for k in ("tokens", "gpu_seconds", "wall_seconds")} == {
        k: task["estimate"][k] for k in ("tokens", "gpu_seconds", "wall_seconds")}


def dry_estimate(client: TestClient, tenant: TenantKey, file_id: str) -> dict[str, Any]:
    r = client.post("/v1/tasks?dry_run=true", json=body(file_id), headers=tenant.headers)
    assert r.status_code == 200, r.text
    return dict(r.json()["estimate"])


def test_the_estimate_says_what_it_rests_on_and_its_band(client: TestClient, tenant: TenantKey) -> None:
    """On the priors of the workers' device kind, with the priors' band; fitted from the model's packs on that kind,
    with the narrower fitted band; in the dry run, the expansion and the stored task alike."""
    file_id = upload(client, tenant)["id"]
    add_worker("gpu-1", memory_bytes=80 * 2**30)
    got = dry_estimate(client, tenant, file_id)
    assert got["basis"] == {"source": "prior", "device_kind": "cuda", "packs": 0}
    low, high = PRIOR_BAND["cuda"]
    assert got["wall_seconds_low"] == pytest.approx(got["wall_seconds"] * low, abs=1e-3)
    assert got["wall_seconds_high"] == pytest.approx(got["wall_seconds"] * high, abs=1e-3)
    assert got["wall_seconds_low"] < got["wall_seconds"] < got["wall_seconds_high"]
    expanded = client.post("/v1/search-spaces/expand", headers=tenant.headers, json={
        "search_space": SPACE, "base_model": MODEL, "training_file": file_id, "max_steps": 50, "max_seq_len": 128})
    assert expanded.json()["estimate"] == {k: v for k, v in got.items() if k != "actual"}
    profile = {"samples": [[4, 2048, 0, 0.05, 3 * 2**30], [8, 4096, 0, 0.09, 4 * 2**30]]}
    with session_scope() as s:
        for i in range(2):
            s.add(Pack(id=f"pack-{i}", worker_id="gpu-1", base_model=MODEL, state="finished", trial_ids=[],
                       profile=profile, created_at=utcnow()))
    fitted = dry_estimate(client, tenant, file_id)
    assert fitted["basis"] == {"source": "fitted", "device_kind": "cuda", "packs": 2}
    assert (fitted["wall_seconds_low"], fitted["wall_seconds_high"]) == pytest.approx(
        (fitted["wall_seconds"] * FITTED_BAND[0], fitted["wall_seconds"] * FITTED_BAND[1]), abs=1e-3)
    assert fitted["wall_seconds_high"] / fitted["wall_seconds_low"] < got["wall_seconds_high"] / got["wall_seconds_low"]
    task = client.post("/v1/tasks", json=body(file_id), headers=tenant.headers).json()
    stored = client.get(f"/v1/tasks/{task['id']}", headers=tenant.headers).json()["estimate"]
    assert stored["basis"] == fitted["basis"] and stored["wall_seconds_high"] == fitted["wall_seconds_high"]


def test_a_cpu_worker_is_estimated_on_cpu_priors_and_cpu_packs_only(client: TestClient, tenant: TenantKey) -> None:
    """Issue 32: a CPU worker's task was estimated from the H100 priors (200x short). On a CPU-only cluster the
    estimate rests on the CPU priors; a CPU pack's profile teaches the CPU estimate and not a GPU one, and a GPU
    pack's not the CPU one."""
    file_id = upload(client, tenant)["id"]
    add_worker("cpu-1", device="cpu")
    on_cpu = dry_estimate(client, tenant, file_id)
    assert on_cpu["basis"] == {"source": "prior", "device_kind": CPU_DEVICE_KIND, "packs": 0}
    with session_scope() as s:
        parameters = s.get(BaseModelEntry, MODEL).parameters  # type: ignore[union-attr]
    expected = estimate([TrialLoad(50, 4 * 128)] * 4, prior_cost(parameters, CPU_DEVICE_KIND), [UsableWorker()],
                        max_trials_per_pack=32, on_priors=True, kind=CPU_DEVICE_KIND).as_dict()
    assert on_cpu == {**expected, "actual": None}
    assert on_cpu["wall_seconds_low"] < on_cpu["wall_seconds"] < on_cpu["wall_seconds_high"]
    # A slow CPU pack: the CPU estimate is fitted on it.
    cpu_profile = {"samples": [[4, 2048, 0, 5.0, None], [8, 4096, 0, 9.0, None]]}
    with session_scope() as s:
        s.add(Pack(id="pack-cpu", worker_id="cpu-1", base_model=MODEL, state="finished", trial_ids=[],
                   profile=cpu_profile, created_at=utcnow()))
    cpu_fitted = dry_estimate(client, tenant, file_id)
    assert cpu_fitted["basis"] == {"source": "fitted", "device_kind": CPU_DEVICE_KIND, "packs": 1}
    # A GPU worker joins: the estimate plans on it, on the GPU priors; the CPU pack taught it nothing.
    add_worker("gpu-1", memory_bytes=80 * 2**30)
    on_gpu = dry_estimate(client, tenant, file_id)
    assert on_gpu["basis"] == {"source": "prior", "device_kind": "cuda", "packs": 0}
    assert on_gpu["wall_seconds"] == prior_estimate(4, 50, 4 * 128, [UsableWorker(80 * 2**30)])["wall_seconds"]
    assert on_gpu["wall_seconds"] < cpu_fitted["wall_seconds"]
    # A GPU pack: the GPU estimate is fitted on it alone, and the CPU pack is not among its packs.
    with session_scope() as s:
        s.add(Pack(id="pack-gpu", worker_id="gpu-1", base_model=MODEL, state="finished", trial_ids=[],
                   profile={"samples": [[4, 2048, 0, 0.05, None], [8, 4096, 0, 0.09, None]]}, created_at=utcnow()))
    gpu_fitted = dry_estimate(client, tenant, file_id)
    assert gpu_fitted["basis"] == {"source": "fitted", "device_kind": "cuda", "packs": 1}
    gpu_step = fit_profiles(samples_from_profiles([{"samples": [[4, 2048, 0, 0.05, None], [8, 4096, 0, 0.09, None]]}]))
    assert gpu_fitted["gpu_seconds"] == estimate(
        [TrialLoad(50, 4 * 128)] * 4, ModelCost(*gpu_step, packs=1), [UsableWorker(80 * 2**30)],
        max_trials_per_pack=32, on_priors=False).gpu_seconds
    # And the GPU pack taught the CPU estimate nothing: with the GPU worker gone, it is the CPU fit of before.
    update_row(Worker, "gpu-1", state="lost")
    assert dry_estimate(client, tenant, file_id) == cpu_fitted
