"""GET /v1/admin/packs and /v1/admin/cluster: packs with the trials in their slots, the fleet's load."""

from __future__ import annotations

from datetime import timedelta

from fastapi.testclient import TestClient

from common.db import session_scope
from common.tables import Pack, Task, Trial, Worker, utcnow
from tests.factories import ADMIN, TenantKey, make_task, trial_ids, update_row, upload


def add_worker(worker_id: str, *, state: str = "alive", max_slots: int = 8, models: list[str] | None = None) -> None:
    with session_scope() as session:
        session.add(Worker(id=worker_id, queue=f"lp:{worker_id}", device="cuda:0", memory_bytes=80 << 30,
                           max_slots=max_slots, state=state, last_heartbeat=utcnow(), registered_at=utcnow(),
                           models=models))


def add_pack(pack_id: str, worker_id: str, trials: list[str], *, state: str = "running", capacity: int | None = 4,
             age_s: int = 0, progress: dict | None = None, profile: dict | None = None) -> None:
    with session_scope() as session:
        session.add(Pack(id=pack_id, worker_id=worker_id, base_model="tiny-random-llama", state=state,
                         trial_ids=trials, capacity=capacity, max_rank=16, target_modules=["q_proj", "v_proj"],
                         progress=progress, profile=profile, created_at=utcnow() - timedelta(seconds=age_s)))
    for trial_id in trials:
        update_row(Trial, trial_id, pack_id=pack_id, state="running")


def test_packs_show_their_slots_and_utilisation(client: TestClient, tenant: TenantKey) -> None:
    task = make_task(client, tenant)
    ids = trial_ids(task["id"])
    add_worker("gpu-0")
    add_pack("pack-a", "gpu-0", ids[:3], progress={"steps": 10, "step_s": 0.5, "tokens": 2048.0, "slots": 3})
    update_row(Trial, ids[2], state="completed")  # finished: its slot is free again though pack_id stays
    update_row(Trial, ids[1], awaiting_admission=True, steps_done=7)

    r = client.get("/v1/admin/packs", headers=ADMIN)
    assert r.status_code == 200, r.text
    [pack] = r.json()["data"]
    assert (pack["id"], pack["object"], pack["state"], pack["worker_id"]) == ("pack-a", "pack", "running", "gpu-0")
    assert (pack["capacity"], pack["free_slots"], pack["utilisation"], pack["trials_placed"]) == (4, 2, 0.5, 3)
    assert [s["trial_id"] for s in pack["slots"]] == ids[:2]
    assert pack["slots"][1] | {"tenant_id": None} == {
        "trial_id": ids[1], "task_id": task["id"], "tenant_id": None, "index": 1, "state": "running",
        "steps_done": 7, "total_steps": pack["slots"][1]["total_steps"], "awaiting_admission": True}
    assert pack["slots"][0]["tenant_id"] == tenant.id
    assert (pack["step_s"], pack["tokens_per_s"]) == (0.5, 4096.0)
    assert client.get("/v1/admin/packs/pack-a", headers=ADMIN).json() == pack


def test_packs_filter_by_state_newest_first(client: TestClient, tenant: TenantKey) -> None:
    ids = trial_ids(make_task(client, tenant)["id"])
    add_worker("gpu-0")
    add_pack("pack-old", "gpu-0", ids[:1], state="finished", capacity=None, age_s=60)
    add_pack("pack-new", "gpu-0", ids[1:3], state="running")
    live = client.get("/v1/admin/packs", headers=ADMIN).json()["data"]
    assert [p["id"] for p in live] == ["pack-new"]
    every = client.get("/v1/admin/packs?state=all", headers=ADMIN).json()
    assert [p["id"] for p in every["data"]] == ["pack-new", "pack-old"] and every["has_more"] is False
    [old] = client.get("/v1/admin/packs?state=finished", headers=ADMIN).json()["data"]
    # No recorded capacity (no back-fills): sized for its trials; ended, it holds no slot.
    assert (old["capacity"], old["slots"], old["utilisation"]) == (1, [], 0.0)
    assert client.get("/v1/admin/packs?state=all&limit=1", headers=ADMIN).json()["has_more"] is True
    r = client.get("/v1/admin/packs?state=sleeping", headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["param"] == "state"
    r = client.get("/v1/admin/packs/pack-nope", headers=ADMIN)
    assert r.status_code == 404


# A `pack.profile` report as a worker sends it at a pack's end (worker/profile.py's summary plus `phases`).
PROFILE = {
    "device": "cuda:0", "steps": 3, "first_step_s": 4.75, "seconds": 0.9, "tokens_per_s": 5120.5,
    "padded_fraction": 0.125, "peak_memory_bytes": 3 << 30,
    "step_breakdown_s": {"data": 0.01, "prefetch_overlapped": 0.2, "device_wait": 0.7, "host_other": 0.19},
    "captured_steps": 2, "samples": [[2, 512, 64, 0.4, 3 << 30], [2, 512, 64, 0.25, None], [1, 256, 0, 0.25, 1 << 30]],
    "sample_fields": ["active_slots", "tokens", "padded_tokens", "seconds", "peak_memory_bytes"],
    "phases": {"wall_s": 20.0, "load_s": 3.0, "capture_s": 1.5, "steps_s": 0.9, "validation_s": 2.0,
               "metric_s": 0.5, "snapshot_s": 0.25, "persist_s": 6.0, "export_s": 0.1, "idle_s": 1.25,
               "outside_steps_frac": 0.955},
}


def test_a_finished_pack_shows_where_its_wall_time_went(client: TestClient, tenant: TenantKey) -> None:
    ids = trial_ids(make_task(client, tenant)["id"])
    add_worker("gpu-0")
    add_pack("pack-done", "gpu-0", ids[:2], state="finished", profile=PROFILE)
    add_pack("pack-live", "gpu-0", ids[2:4], state="running", age_s=-1)

    r = client.get("/v1/admin/packs/pack-done", headers=ADMIN)
    assert r.status_code == 200, r.text
    profile = r.json()["profile"]
    assert profile["phases"] == {
        "wall_s": 20.0, "load_s": 3.0, "capture_s": 1.5, "steps_s": 0.9, "validation_s": 2.0, "metric_s": 0.5,
        "snapshot_s": 0.25, "persist_s": 6.0, "export_s": 0.1, "idle_s": 1.25, "outside_steps_frac": 0.955,
        # The wall time no training-thread phase accounts for (persist runs beside them on the writer thread).
        "other_s": 10.5}
    rest = {k: v for k, v in profile.items() if k != "phases"}
    assert rest == {**{k: v for k, v in PROFILE.items() if k != "phases"}, "gpus": None, "shared_device": False}
    # The list has every pack's profile but not its samples; a pack still running has none yet.
    listed = {p["id"]: p for p in client.get("/v1/admin/packs?state=all", headers=ADMIN).json()["data"]}
    assert listed["pack-done"]["profile"] == {**profile, "samples": None}
    assert listed["pack-live"]["profile"] is None
    assert client.get("/v1/admin/packs/pack-live", headers=ADMIN).json()["profile"] is None


def test_profiles_of_older_workers_read_under_the_new_names(client: TestClient, tenant: TenantKey) -> None:
    ids = trial_ids(make_task(client, tenant)["id"])
    add_worker("gpu-0")
    # Before issue 30: no load, capture or persist, and three phases under their first names.
    older = {"wall_s": 10.0, "steps_s": 4.0, "validation_s": 1.5, "metric_s": 0.0, "checkpoints_s": 0.5,
             "exports_s": 0.25, "waiting_s": 2.0, "outside_steps_frac": 0.6}
    add_pack("pack-older", "gpu-0", ids[:1], state="finished", profile={"device": "cpu", "steps": 4, "phases": older})
    # Before phases were reported at all, and a profile whose values are not what they should be.
    add_pack("pack-oldest", "gpu-0", ids[1:2], state="finished", profile={"device": "cpu", "steps": 4})
    add_pack("pack-garbled", "gpu-0", ids[2:3], state="finished", profile={
        "device": 7, "steps": "many", "tokens_per_s": "fast", "step_breakdown_s": [1], "samples": "none",
        "phases": {"wall_s": "long", "steps_s": True, "idle_s": 1.0}})

    read = {p: client.get(f"/v1/admin/packs/{p}", headers=ADMIN) for p in ("pack-older", "pack-oldest", "pack-garbled")}
    assert all(r.status_code == 200 for r in read.values()), {p: r.text for p, r in read.items()}
    phases = read["pack-older"].json()["profile"]["phases"]
    assert phases == {"wall_s": 10.0, "load_s": None, "capture_s": None, "steps_s": 4.0, "validation_s": 1.5,
                      "metric_s": 0.0, "snapshot_s": 0.5, "persist_s": None, "export_s": 0.25, "idle_s": 2.0,
                      "other_s": 1.75, "outside_steps_frac": 0.6}
    oldest = read["pack-oldest"].json()["profile"]
    assert (oldest["device"], oldest["steps"], oldest["phases"], oldest["samples"]) == ("cpu", 4, None, None)
    garbled = read["pack-garbled"].json()["profile"]
    assert (garbled["device"], garbled["steps"], garbled["tokens_per_s"], garbled["step_breakdown_s"]) == (
        None, None, None, None)
    assert (garbled["phases"]["wall_s"], garbled["phases"]["steps_s"], garbled["phases"]["idle_s"],
            garbled["phases"]["other_s"]) == (None, None, 1.0, None)


def test_cluster_sums_workers_slots_and_tenants(client: TestClient, tenant: TenantKey,
                                                other_tenant: TenantKey) -> None:
    ids = trial_ids(make_task(client, tenant)["id"])  # 4 trials
    make_task(client, other_tenant)  # 4 pending trials
    add_worker("gpu-0", max_slots=4)
    add_worker("gpu-1", max_slots=4)
    add_worker("gpu-2", state="lost", max_slots=8)
    add_pack("pack-a", "gpu-0", ids[:3])

    r = client.get("/v1/admin/cluster", headers=ADMIN)
    assert r.status_code == 200, r.text
    c = r.json()
    assert c["object"] == "cluster"
    assert (c["workers_alive"], c["workers_lost"], c["workers_busy"]) == (2, 1, 1)
    assert (c["slots_total"], c["slots_used"], c["utilisation"]) == (8, 3, 0.375)
    assert (c["trials_pending"], c["trials_running"]) == (5, 3)
    workers = {w["id"]: w for w in c["workers"]}
    assert (workers["gpu-0"]["pack_id"], workers["gpu-0"]["used_slots"], workers["gpu-0"]["utilisation"]) == (
        "pack-a", 3, 0.75)
    assert (workers["gpu-1"]["pack_id"], workers["gpu-1"]["used_slots"]) == (None, 0)
    assert workers["gpu-2"]["state"] == "lost" and workers["gpu-0"]["device"] == "cuda:0"
    assert [(t["name"], t["running_trials"], t["pending_trials"]) for t in c["tenants"]] == [
        ("acme", 3, 1), ("globex", 0, 4)]


def test_each_worker_says_which_models_it_can_load(client: TestClient) -> None:
    add_worker("gpu-0", models=["smollm2-135m-instruct", "tiny-random-llama"])
    add_worker("gpu-1")  # its heartbeat does not say: taken as able to load every model
    add_worker("gpu-2", models=[])
    workers = {w["id"]: w["models"] for w in client.get("/v1/admin/cluster", headers=ADMIN).json()["workers"]}
    assert workers == {"gpu-0": ["smollm2-135m-instruct", "tiny-random-llama"], "gpu-1": None, "gpu-2": []}
    listed = {w["id"]: w["models"] for w in client.get("/v1/admin/workers", headers=ADMIN).json()["data"]}
    assert listed == workers


def test_each_worker_shows_the_models_it_holds_warm(client: TestClient) -> None:
    add_worker("gpu-0")
    add_worker("gpu-1")  # its heartbeat does not say
    warm = [{"name": "smollm2-135m-instruct", "revision": "2af2ce4a606345ac", "bytes": 538_062_336,
             "last_used_at": 1796212800.25},
            {"name": "tiny-random-llama", "revision": "tiny-random-llama", "bytes": 428_800,
             "last_used_at": 1796212000.0}]
    with session_scope() as session:
        session.get_one(Worker, "gpu-0").warm_models = warm
    workers = {w["id"]: w["warm_models"] for w in client.get("/v1/admin/cluster", headers=ADMIN).json()["workers"]}
    assert workers["gpu-1"] is None
    assert workers["gpu-0"] == [
        {"name": "smollm2-135m-instruct", "revision": "2af2ce4a606345ac", "bytes": 538_062_336,
         "last_used_at": "2026-12-02T12:00:00.250000Z"},
        {"name": "tiny-random-llama", "revision": "tiny-random-llama", "bytes": 428_800,
         "last_used_at": "2026-12-02T11:46:40Z"}]
    listed = {w["id"]: w["warm_models"] for w in client.get("/v1/admin/workers", headers=ADMIN).json()["data"]}
    assert listed == workers


def test_an_empty_cluster_has_no_utilisation(client: TestClient) -> None:
    c = client.get("/v1/admin/cluster", headers=ADMIN).json()
    assert (c["workers_alive"], c["slots_total"], c["utilisation"], c["workers"], c["tenants"]) == (0, 0, 0.0, [], [])


def test_packs_and_cluster_are_for_the_operator_only(client: TestClient, tenant: TenantKey) -> None:
    for path in ("/v1/admin/packs", "/v1/admin/cluster"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers=tenant.headers).status_code == 403


def test_each_tenants_row_shows_what_preemption_weighs(client: TestClient, tenant: TenantKey,
                                                       other_tenant: TenantKey) -> None:
    """Its weight, its GPU time over the fairness window (what its usage bills: a running pack's time so far), and
    its trials held back for another tenant."""
    ids = trial_ids(make_task(client, tenant)["id"])
    waiting = trial_ids(make_task(client, other_tenant)["id"])
    add_worker("gpu-0", max_slots=4)
    add_pack("pack-a", "gpu-0", ids[:2])
    with session_scope() as session:
        session.get_one(Pack, "pack-a").started_at = utcnow() - timedelta(seconds=600)
    update_row(Trial, waiting[0], preempted_for=tenant.id)
    r = client.patch(f"/v1/admin/tenants/{tenant.id}", json={"weight": 2}, headers=ADMIN)
    assert r.status_code == 200, r.text

    rows = {t["name"]: t for t in client.get("/v1/admin/cluster", headers=ADMIN).json()["tenants"]}
    acme, globex = rows["acme"], rows["globex"]
    assert acme["weight"] == 2.0 and globex["weight"] == 1.0
    assert 600 <= acme["gpu_seconds_window"] < 660 and globex["gpu_seconds_window"] == 0.0
    assert (acme["held_trials"], globex["held_trials"]) == (0, 1)


def test_a_worker_running_two_packs_shows_both_their_memory_and_who_waits_why(
    client: TestClient, tenant: TenantKey, other_tenant: TenantKey
) -> None:
    """Issue 34: a worker runs packs of two models at once (worker/colocation.py): the cluster lists both, each
    with the memory reserved for it, and what they left free; a tenant's waiting task says why it waits."""
    ids = trial_ids(make_task(client, tenant)["id"])
    waiting_task = make_task(client, other_tenant)
    add_worker("gpu-0", max_slots=8)
    add_pack("pack-a", "gpu-0", ids[:2])
    add_pack("pack-b", "gpu-0", ids[2:3], age_s=-1)
    with session_scope() as session:
        worker = session.get_one(Worker, "gpu-0")
        worker.max_packs, worker.free_memory_bytes = 2, 50 << 30
        session.get_one(Pack, "pack-a").memory_bytes = 20 << 30
        session.get_one(Pack, "pack-b").memory_bytes = 10 << 30
        task = session.get_one(Task, waiting_task["id"])
        task.waiting = {"reason": "does_not_fit", "message": "4 trials waiting: no worker has the memory for them",
                        "position": 1, "estimated_start_at": None, "waiting_trials": 4,
                        "updated_at": "2026-11-27T09:00:00Z"}

    c = client.get("/v1/admin/cluster", headers=ADMIN).json()
    [w] = c["workers"]
    assert (w["max_packs"], w["free_memory_bytes"], w["pack_id"], w["used_slots"]) == (2, 50 << 30, "pack-a", 3)
    assert w["packs"] == [
        {"id": "pack-a", "base_model": "tiny-random-llama", "state": "running", "used_slots": 2,
         "memory_bytes": 20 << 30},
        {"id": "pack-b", "base_model": "tiny-random-llama", "state": "running", "used_slots": 1,
         "memory_bytes": 10 << 30}]
    assert c["workers_busy"] == 1 and c["slots_used"] == 3
    rows = {t["name"]: t for t in c["tenants"]}
    assert rows["acme"]["waiting"] == []
    [told] = rows["globex"]["waiting"]
    assert told["task_id"] == waiting_task["id"] and told["waiting"]["reason"] == "does_not_fit"
    assert "memory" in told["waiting"]["message"]
    packs = {p["id"]: p for p in client.get("/v1/admin/packs", headers=ADMIN).json()["data"]}
    assert packs["pack-b"]["memory_bytes"] == 10 << 30
    listed = {x["id"]: x for x in client.get("/v1/admin/workers", headers=ADMIN).json()["data"]}
    assert (listed["gpu-0"]["max_packs"], listed["gpu-0"]["free_memory_bytes"]) == (2, 50 << 30)


def test_a_task_whose_wait_was_cleared_while_a_trial_is_pending_again_is_not_waiting(
    client: TestClient, tenant: TenantKey
) -> None:
    """The scheduler clears `waiting` to None once a task's trials start, which the JSON column stores as JSON null
    (not SQL NULL); a trial requeued after its worker died is pending again. The cluster view answered 500 for such
    a task (a distributed chaos test's crash loop hit it); it lists it as not waiting."""
    task = make_task(client, tenant)
    with session_scope() as session:
        session.get_one(Task, task["id"]).waiting = {"reason": "no_worker", "message": "m", "position": 1,
                                                    "estimated_start_at": None, "waiting_trials": 4,
                                                    "updated_at": "2026-11-27T09:00:00Z"}
    with session_scope() as session:
        session.get_one(Task, task["id"]).waiting = None  # its trials started; one is pending again below
    r = client.get("/v1/admin/cluster", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert all(row["waiting"] == [] for row in r.json()["tenants"])


def test_the_cluster_pages_its_workers_and_counts_every_one(client: TestClient, tenant: TenantKey) -> None:
    """The workers list grows with the cluster: it comes a page at a time (`limit`, `after`, `has_more`), registered
    first first, while the figures above it (alive, lost, busy, slots) count every worker."""
    ids = trial_ids(make_task(client, tenant)["id"])
    for i in range(5):
        add_worker(f"gpu-{i}", state="lost" if i == 1 else "alive", max_slots=4)
        update_row(Worker, f"gpu-{i}", registered_at=utcnow() - timedelta(seconds=100 - i))
    add_pack("pack-a", "gpu-4", ids[:3])  # on the last page

    first = client.get("/v1/admin/cluster?limit=2", headers=ADMIN).json()
    assert [w["id"] for w in first["workers"]] == ["gpu-0", "gpu-1"]
    assert (first["has_more"], first["workers_total"]) == (True, 5)
    assert (first["workers_alive"], first["workers_lost"], first["workers_busy"]) == (4, 1, 1)
    assert (first["slots_total"], first["slots_used"], first["trials_running"]) == (16, 3, 3)
    second = client.get("/v1/admin/cluster?limit=2&after=gpu-1", headers=ADMIN).json()
    assert [w["id"] for w in second["workers"]] == ["gpu-2", "gpu-3"] and second["has_more"] is True
    last = client.get("/v1/admin/cluster?limit=2&after=gpu-3", headers=ADMIN).json()
    assert [(w["id"], w["pack_id"], w["used_slots"]) for w in last["workers"]] == [("gpu-4", "pack-a", 3)]
    assert last["has_more"] is False and {k: v for k, v in last.items() if k not in ("workers", "has_more")} == {
        k: v for k, v in first.items() if k not in ("workers", "has_more")}
    every = client.get("/v1/admin/cluster", headers=ADMIN).json()  # 100 by default
    assert len(every["workers"]) == 5 and every["has_more"] is False

    r = client.get("/v1/admin/cluster?after=gpu-nope", headers=ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_cursor"
    assert client.get("/v1/admin/cluster?limit=0", headers=ADMIN).status_code == 422


def test_the_views_gpu_time_by_tenant_is_what_usage_bills(client: TestClient, tenant: TenantKey,
                                                          other_tenant: TenantKey) -> None:
    """Each tenant's GPU time over the window, as the cluster view, the fairness rule and billing read it
    (common.usage.gpu_seconds_by_tenant, summed from a few columns and aggregates), is its trials' shares by the
    per-trial rule (gpu_seconds_by_trial): packs side by side on a worker split its time, a pack's time goes by its
    trials' reported tokens, equally without reports or when it was lost (to a trial since moved to another pack
    too), a pack that ended before the window counts nothing."""
    from common.tables import TrialUsage
    from common.usage import gpu_seconds_by_tenant, gpu_seconds_by_trial

    mine, theirs = trial_ids(make_task(client, tenant)["id"]), trial_ids(make_task(client, other_tenant)["id"])
    add_worker("gpu-0")
    add_worker("gpu-1")
    now = utcnow()
    add_pack("pack-live", "gpu-0", [mine[0], theirs[0]])  # no report yet: equal shares
    add_pack("pack-beside", "gpu-0", [theirs[1]])  # beside it on gpu-0: they split the GPU's time
    add_pack("pack-done", "gpu-1", [mine[1], theirs[2]], state="finished")  # reported: by tokens
    add_pack("pack-lost", "gpu-1", [mine[2], theirs[3]], state="lost")  # lost: equally, whatever it reported
    add_pack("pack-old", "gpu-1", [mine[3]], state="finished")  # ended before the window
    add_pack("pack-next", "gpu-0", [theirs[3]])  # the lost pack's trial moved on
    update_row(Trial, mine[2], pack_id=None, state="pending")  # and another is back in the queue
    spans = {"pack-live": (900, None), "pack-beside": (600, None), "pack-done": (3000, 2000),
             "pack-lost": (1500, 1000), "pack-old": (9000, 8000), "pack-next": (300, None)}
    with session_scope() as session:
        for pack_id, (start, end) in spans.items():
            pack = session.get_one(Pack, pack_id)
            pack.started_at = now - timedelta(seconds=start)
            pack.finished_at = None if end is None else now - timedelta(seconds=end)
        for pack_id, trial_id, owner, tokens in (("pack-done", mine[1], tenant.id, 3000),
                                                 ("pack-done", theirs[2], other_tenant.id, 1000),
                                                 ("pack-lost", mine[2], tenant.id, 5000)):
            task_id = session.get_one(Trial, trial_id).task_id
            session.add(TrialUsage(pack_id=pack_id, trial_id=trial_id, task_id=task_id, tenant_id=owner,
                                   tokens=tokens, steps=10, end_step=10, created_at=now))
    window = (now - timedelta(seconds=3600), now)
    with session_scope() as session:
        billed = gpu_seconds_by_tenant(session, window, now)
        owners = dict.fromkeys(mine, tenant.id) | dict.fromkeys(theirs, other_tenant.id)
        by_trial: dict[str, float] = {}
        for trial_id, share in gpu_seconds_by_trial(session, window, now).items():
            by_trial[owners[trial_id]] = by_trial.get(owners[trial_id], 0.0) + share
    assert set(by_trial) == set(billed) == {tenant.id, other_tenant.id}
    assert all(abs(by_trial[t] - billed[t]) < 1e-6 for t in billed), (by_trial, billed)
    assert billed[tenant.id] > 0 and billed[other_tenant.id] > 0


def test_a_tenants_waiting_tasks_are_capped_to_the_next_to_start(client: TestClient, tenant: TenantKey) -> None:
    """`waiting` grows with a tenant's queue: it lists the oldest WAITING_SHOWN (the next to start), and
    `waiting_tasks` says how many wait."""
    from api.services.cluster import WAITING_SHOWN

    file_id = upload(client, tenant)["id"]
    tasks = [make_task(client, tenant, file_id)["id"] for _ in range(WAITING_SHOWN + 2)]
    with session_scope() as session:
        for i, task_id in enumerate(tasks):
            task = session.get_one(Task, task_id)
            task.created_at = utcnow() - timedelta(seconds=100 - i)
            task.waiting = {"reason": "no_worker", "message": f"waiting {i}", "position": i + 1,
                            "estimated_start_at": None, "waiting_trials": 4, "updated_at": "2026-12-02T09:00:00Z"}
    [row] = client.get("/v1/admin/cluster", headers=ADMIN).json()["tenants"]
    assert [w["task_id"] for w in row["waiting"]] == tasks[:WAITING_SHOWN]
    assert (row["waiting_tasks"], row["pending_trials"]) == (WAITING_SHOWN + 2, 4 * (WAITING_SHOWN + 2))
