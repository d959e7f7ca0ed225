"""The dashboard's reads over a cluster at scale (issue 53): PostgreSQL seeded in bulk to the shape of a busy
service, `loraplane api --workers 2` in front of it, and every request the dashboard's tasks and cluster pages
make timed, with tenants polling their tasks' status meanwhile.

    python -m benchmarks.dashboard_scale --tasks 10000 --workers 256 --tenants 50
    git archive dd05562 | tar -x -C /tmp/before  # then, side by side with that code on the same machine:
    python -m benchmarks.dashboard_scale --baseline /tmp/before

The database (a private one, dropped at the end) is migrated as the service migrates it (`loraplane migrate`) and
filled with SQL `INSERT ... SELECT generate_series` into the service's tables:
- `--tenants` tenants holding `--tasks` finished tasks between them, and one more tenant holding `--tasks` by itself
  (the tasks page of a tenant with a long history), each task `--trials-per-task` finished trials with
  `--points-per-trial` metric points each (train points, and a validation point every fourth step);
- `--workers` workers with fresh heartbeats, each running a live pack of 32 trials (running tasks of 8 trials, with
  their points so far), the finished packs that ran the finished trials (eight tasks a pack) with their profiles and
  usage reports, four a worker over the last hour (what the cluster view's GPU time over the fairness window reads)
  and the rest before, and queued tasks whose pending trials wait.

Timed, round-robin so that the machine's noise falls on every request alike (`--reads` rounds, after warm-up):
- the tasks page (api/static/js/pages/tasks.js): `GET /v1/tasks?limit=50` with a tenant's key (the large tenant's
  and an ordinary one's), and as the operator `GET /v1/admin/tenants?limit=100&include_deleted=true` (its tenant
  filter), `GET /v1/tasks?limit=50` (every tenant's) and `...&tenant_id=` (the large tenant's);
- the cluster page (api/static/js/pages/cluster.js): `GET /v1/admin/cluster`, `GET /v1/admin/packs?state=live`,
  `GET /v1/admin/packs?state=finished&limit=6`;
- a tenant's status read `GET /v1/tasks/{id}`, from `--pollers` threads polling random tasks throughout.

With `--baseline DIR` a second API runs the code of DIR (an earlier commit's tree) on a second database seeded
alike, the reads alternating between the two each round and each polled alike: on a shared machine whose load
comes and goes, the two are compared under the same noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from cryptography.fernet import Fernet
from sqlalchemy import Connection, create_engine, text

from benchmarks.cluster_scale import Latencies, forget_namespace, free_port, wait_until
from benchmarks.common import write_result
from common.tables import ApiKey, BaseModelEntry, File, MetricPoint, Pack, Task, Tenant, Trial, TrialUsage, Worker
from common.task_spec import TaskSpec

ROOT = Path(__file__).resolve().parents[1]
SERVER_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN_TOKEN = "lpadmin_dashboard_scale"
MODEL = "tiny-random-llama"
SLOTS = 32  # a live pack's trials
RUNNING_TRIALS_PER_TASK = 8  # so a pack holds four running tasks' trials
QUEUED_TASKS = 200  # tasks whose 8 trials are all pending, with why they wait
FINISHED_PACKS_PER_WORKER = 4  # over the last hour: the cluster view's fairness window
WEIGHTS = (1, 1, 2, 4)
CLUSTER_WORKERS_SHOWN = 100  # the cluster page's page of workers (cluster.js WORKERS_SHOWN; a code without
# pagination ignores the parameter and answers every worker)
TARGETS_MS = {"tasks": 300.0, "cluster": 300.0, "status": 100.0}  # p99 targets (issue 53)


@dataclass(frozen=True)
class Shape:
    tasks: int  # finished tasks spread over the tenants, and as many again for the large tenant
    workers: int
    tenants: int
    trials_per_task: int = 4
    points_per_trial: int = 20

    @property
    def running_tasks(self) -> int:
        return self.workers * SLOTS // RUNNING_TRIALS_PER_TASK


def spec_json() -> str:
    """A stored task spec as the API writes one (a grid of four learning rates); the file ids are the row's own."""
    spec = TaskSpec(base_model=MODEL, training_file="file", validation_file=None, validation_split=0.2,
                    strategy="grid", search_space={"learning_rate": [1e-4, 3e-4, 1e-3, 3e-3], "lora_rank": [8],
                                                   "batch_size": [4], "target_modules": [["q_proj", "v_proj"]]},
                    max_trials=None, epochs=None, max_steps=200, max_seq_len=512, eval_interval=20,
                    training_rows=800, validation_rows=200)
    return json.dumps(spec.to_stored())


def profile_json() -> str:
    """A finished pack's profile as a worker reports it (worker/profile.py's summary, its phases and samples)."""
    samples = [[32, 16384, 1024, 0.41, 30 << 30] for _ in range(64)]
    return json.dumps({
        "device": "cuda:0", "steps": 400, "first_step_s": 6.5, "seconds": 164.0, "tokens_per_s": 37000.0,
        "padded_fraction": 0.06, "peak_memory_bytes": 31 << 30, "captured_steps": 390,
        "step_breakdown_s": {"data": 0.5, "prefetch_overlapped": 9.0, "device_wait": 150.0, "host_other": 13.5},
        "sample_fields": ["active_slots", "tokens", "padded_tokens", "seconds", "peak_memory_bytes"],
        "samples": samples,
        "phases": {"wall_s": 190.0, "load_s": 4.0, "capture_s": 2.5, "steps_s": 164.0, "validation_s": 12.0,
                   "metric_s": 0.0, "snapshot_s": 1.0, "persist_s": 3.0, "export_s": 1.5, "idle_s": 0.5,
                   "other_s": 4.5, "outside_steps_frac": 0.137}})


def _tenant_of(g: str, shape: Shape) -> str:
    """SQL: the tenant id of spread task number `g` (the large tenant is 'tenant-big')."""
    return f"'tenant-' || lpad(({g} % {shape.tenants})::text, 3, '0')"


def seed_accounts(conn: Connection, shape: Shape) -> dict[str, str]:
    """The tenants (the large one last), a key and a file each, the model; the tenants' keys by tenant id."""
    now = datetime.now(UTC)
    conn.execute(text(f"INSERT INTO {BaseModelEntry.__tablename__} (name, kind, description, created_at) "
                      "VALUES (:m, :m, '', :now)"), {"m": MODEL, "now": now})
    ids = [f"tenant-{i:03d}" for i in range(shape.tenants)] + ["tenant-big"]
    keys = {tenant_id: f"lp_{secrets.token_urlsafe(32)}" for tenant_id in ids}
    for i, tenant_id in enumerate(ids):
        conn.execute(text(
            f"INSERT INTO {Tenant.__tablename__} (id, name, weight, max_concurrent_trials, max_trials_per_task, "
            "max_file_bytes, max_storage_bytes, max_files, created_at) "
            "VALUES (:id, :id, :w, 100000, 64, 1000000000, 100000000000, 1000, :at)"),
            {"id": tenant_id, "w": WEIGHTS[i % len(WEIGHTS)], "at": now - timedelta(days=30)})
        conn.execute(text(
            f"INSERT INTO {ApiKey.__tablename__} (id, tenant_id, name, prefix, key_hash, created_at) "
            "VALUES (:id, :tenant, '', :prefix, :hash, :at)"),
            # The key's sha256, as the API keeps it (api/deps.py hash_api_key: benchmarks import nothing of api/).
            {"id": f"key-{tenant_id}", "tenant": tenant_id, "prefix": keys[tenant_id][:12],
             "hash": hashlib.sha256(keys[tenant_id].encode()).hexdigest(), "at": now - timedelta(days=30)})
        conn.execute(text(
            f"INSERT INTO {File.__tablename__} (id, tenant_id, filename, purpose, bytes, rows, format, sha256, "
            "storage_key, created_at) VALUES (:id, :tenant, 'rows.jsonl', 'fine-tune', 120000, 1000, "
            "'prompt_completion', :sha, :key, :at)"),
            {"id": f"file-{tenant_id}", "tenant": tenant_id, "sha": "0" * 64, "key": f"files/{tenant_id}",
             "at": now - timedelta(days=30)})
    return keys


# A succeeded task's best trial: its first (a tenth have none: their metric picked none, the list reads them so).
BEST_TRIAL = "CASE WHEN g % 10 = 0 THEN NULL ELSE 'trial-' || lpad(g::text, 8, '0') || '-0' END"


def seed_tasks(conn: Connection, shape: Shape) -> None:
    """Every task: finished ones (spread, then the large tenant's), running ones, queued ones; newest last. Task g
    was created 30 s after task g - 1 of its kind."""
    n, r = shape.tasks, shape.running_tasks
    spread, big = _tenant_of("g", shape), "'tenant-big'"
    waiting = json.dumps({"reason": "no_worker", "message": "8 trials waiting: every worker is busy; 1st in queue",
                          "position": 1, "estimated_start_at": None, "waiting_trials": 8,
                          "updated_at": datetime.now(UTC).isoformat()})
    # (first g, last g, tenant, state, age of the newest in seconds, with a best trial, waiting)
    kinds = [(1, n, spread, "succeeded", 7200, True, False), (n + 1, 2 * n, big, "succeeded", 7100, True, False),
             (2 * n + 1, 2 * n + r, spread, "running", 600, False, False),
             (2 * n + r + 1, 2 * n + r + QUEUED_TASKS, spread, "queued", 0, False, True)]
    for first, last, tenant, state, newest_age, best, waits in kinds:
        created = f"now() - make_interval(secs => {newest_age} + 30 * ({last} - g))"
        started = "NULL" if state == "queued" else f"{created} + interval '5 seconds'"
        finished = f"{created} + interval '15 minutes'" if state == "succeeded" else "NULL"
        conn.execute(text(
            f"INSERT INTO {Task.__tablename__} (id, tenant_id, base_model, training_file_id, state, spec, "
            "best_trial_id, estimate, waiting, created_at, started_at, finished_at) "
            f"SELECT 'task-' || lpad(g::text, 8, '0'), {tenant}, :model, 'file-' || {tenant}, :state, "
            f"CAST(:spec AS json), {BEST_TRIAL if best else 'NULL'}, CAST(:estimate AS json), "
            f"{'CAST(:waiting AS json)' if waits else 'NULL'}, {created}, {started}, {finished} "
            f"FROM generate_series({first}, {last}) AS g"),
            {"model": MODEL, "state": state, "spec": spec_json(), "waiting": waiting,
             "estimate": json.dumps({"tokens": 3_276_800, "gpu_seconds": 820.0, "wall_seconds": 900.0})})


def finished_packs(shape: Shape) -> int:
    """Packs that ran the finished tasks' trials, eight tasks a pack: the last hour's four a worker, and
    before them as many as the rest of the finished tasks took."""
    return max(shape.workers * FINISHED_PACKS_PER_WORKER, 2 * shape.tasks // 8)


def seed_trials(conn: Connection, shape: Shape) -> None:
    """The finished tasks' finished trials (the first tasks' in finished packs, eight tasks a pack), the running
    tasks' running ones (each in its worker's live pack: four tasks a pack), the queued tasks' pending ones (a tenth
    of them held back for another tenant)."""
    n, r, k = shape.tasks, shape.running_tasks, shape.trials_per_task
    in_finished_packs = 8 * finished_packs(shape)
    per_pack = SLOTS // RUNNING_TRIALS_PER_TASK
    columns = ("id, task_id, tenant_id, index, state, hyperparameters, total_steps, steps_done, pack_id, attempts, "
               "best_val_loss, best_step, selection_loss, last_train_loss, preempted_for, created_at, started_at, "
               "finished_at")
    rows = ("SELECT 'trial-' || lpad(g::text, 8, '0') || '-' || i, 'task-' || lpad(g::text, 8, '0'), t.tenant_id, "
            "i, {state}, CAST(:hp AS json), 200, {done}, {pack}, 1, {loss}, {step}, {loss}, 2.1 - i * 0.05, {held}, "
            "t.created_at, t.started_at, t.finished_at FROM generate_series({first}, {last}) AS g "
            "JOIN tasks t ON t.id = 'task-' || lpad(g::text, 8, '0'), generate_series(0, {trials} - 1) AS i")
    hp = json.dumps({"learning_rate": 3e-4, "lora_rank": 8, "batch_size": 4, "target_modules": ["q_proj", "v_proj"]})
    for fields in (
        {"first": 1, "last": 2 * n, "trials": k,
         "state": "CASE WHEN i = 1 AND g % 7 = 0 THEN 'stopped_early' ELSE 'completed' END", "done": "200",
         "pack": f"CASE WHEN g <= {in_finished_packs} THEN 'pack-done-' || ((g - 1) / 8) END",
         "loss": "1.5 + i * 0.1 + (g % 13) * 0.01", "step": "180", "held": "NULL"},
        {"first": 2 * n + 1, "last": 2 * n + r, "trials": RUNNING_TRIALS_PER_TASK, "state": "'running'",
         "done": "20 + (g * 7 + i * 13) % 160", "pack": f"'pack-live-' || ((g - {2 * n + 1}) / {per_pack})",
         "loss": "CASE WHEN (g + i) % 3 = 0 THEN NULL ELSE 1.8 + i * 0.01 END", "step": "20", "held": "NULL"},
        {"first": 2 * n + r + 1, "last": 2 * n + r + QUEUED_TASKS, "trials": RUNNING_TRIALS_PER_TASK,
         "state": "'pending'", "done": "0", "pack": "NULL", "loss": "NULL", "step": "NULL",
         "held": "CASE WHEN g % 10 = 0 THEN 'tenant-big' END"},
    ):
        conn.execute(text(f"INSERT INTO {Trial.__tablename__} ({columns}) " + rows.format(**fields)), {"hp": hp})


def seed_points(conn: Connection, shape: Shape) -> None:
    """Train points at every step up to each trial's points (its steps done, for a running one), a validation
    point every fourth."""
    for split, every in (("train", 1), ("val", 4)):
        conn.execute(text(
            f"INSERT INTO {MetricPoint.__tablename__} (trial_id, step, split, loss, created_at) "
            f"SELECT t.id, s * {every}, '{split}', 2.0 - s * 0.01, t.created_at + make_interval(secs => s) "
            f"FROM {Trial.__tablename__} t, generate_series(1, {shape.points_per_trial // every}) AS s "
            f"WHERE t.state <> 'pending' AND (t.state <> 'running' OR s * {every} <= t.steps_done)"))


PACK_COLUMNS = ("id, worker_id, base_model, state, trial_ids, capacity, max_rank, target_modules, gpus, memory_bytes, "
                "incarnation, progress, profile, created_at, dispatched_at, started_at, finished_at")


def seed_fleet(conn: Connection, shape: Shape) -> None:
    """The workers (fresh heartbeats), each running one live pack of 32 trials; four finished packs a worker over
    the last hour, one every 10 minutes (with profiles, and a usage report a trial)."""
    n = shape.workers
    models, warm = json.dumps([MODEL]), json.dumps([{"name": MODEL, "revision": "main", "bytes": 2_400_000_000,
                                                      "last_used_at": time.time()}])
    conn.execute(text(
        f"INSERT INTO {Worker.__tablename__} (id, queue, device, memory_bytes, gpus, max_slots, max_packs, "
        "free_memory_bytes, state, current_pack_id, incarnation, incarnation_started_at, models, warm_models, "
        "last_heartbeat, registered_at, quarantines) "
        "SELECT 'hollow-' || w, 'lp:hollow-' || w, 'cuda:0 (NVIDIA H200)', 150000000000, 1, 32, 1, 100000000000, "
        "'alive', 'pack-live-' || w, 'inc-' || w, now() - interval '2 hours', CAST(:models AS json), "
        "CAST(:warm AS json), now() - make_interval(secs => w % 5), now() - interval '2 hours', 0 "
        f"FROM generate_series(0, {n - 1}) AS w"), {"models": models, "warm": warm})
    members = "SELECT json_agg(t.id ORDER BY t.id) FROM trials t WHERE t.pack_id = 'pack-{kind}-' || {j}"
    modules = json.dumps(["q_proj", "v_proj"])
    conn.execute(text(
        f"INSERT INTO {Pack.__tablename__} ({PACK_COLUMNS}) "
        f"SELECT 'pack-live-' || w, 'hollow-' || w, :model, 'running', ({members.format(kind='live', j='w')}), 32, "
        "8, CAST(:modules AS json), 1, 30000000000, 'inc-' || w, CAST(:progress AS json), NULL, "
        "now() - interval '10 minutes', now() - interval '10 minutes', now() - interval '9 minutes', NULL "
        f"FROM generate_series(0, {n - 1}) AS w"),
        {"model": MODEL, "modules": modules,
         "progress": json.dumps({"steps": 10, "step_s": 0.41, "tokens": 16384.0, "slots": 32})})
    # The last hour's packs: the worker's k-th, 10 minutes apart; older ones: a day ago and before, 30 s apart.
    recent = n * FINISHED_PACKS_PER_WORKER
    ago = (f"now() - CASE WHEN j < {recent} THEN make_interval(secs => {{s}} - (j / {n}) * 600) "
           f"ELSE interval '1 day' + make_interval(secs => {{s}} + 30 * (j - {recent})) END")
    conn.execute(text(
        f"INSERT INTO {Pack.__tablename__} ({PACK_COLUMNS}) "
        f"SELECT 'pack-done-' || j, 'hollow-' || (j % {n}), :model, 'finished', "
        f"coalesce(({members.format(kind='done', j='j')}), '[]'::json), 32, 8, CAST(:modules AS json), 1, "
        f"30000000000, 'inc-' || (j % {n}), NULL, CAST(:profile AS json), {ago.format(s=3600)}, "
        f"{ago.format(s=3590)}, {ago.format(s=3580)}, {ago.format(s=3390)} "
        f"FROM generate_series(0, {finished_packs(shape) - 1}) AS j"),
        {"model": MODEL, "modules": modules, "profile": profile_json()})
    conn.execute(text(
        f"INSERT INTO {TrialUsage.__tablename__} (pack_id, trial_id, task_id, tenant_id, tokens, steps, end_step, "
        "created_at) SELECT t.pack_id, t.id, t.task_id, t.tenant_id, 819200, 200, 200, p.finished_at "
        f"FROM {Trial.__tablename__} t JOIN {Pack.__tablename__} p ON p.id = t.pack_id WHERE p.state = 'finished'"))


def seed(database_url: str, shape: Shape) -> dict[str, str]:
    """Fills the migrated database; the tenants' keys."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            keys = seed_accounts(conn, shape)
            seed_tasks(conn, shape)
            seed_trials(conn, shape)
            seed_points(conn, shape)
            seed_fleet(conn, shape)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))  # what autovacuum does to a table this size soon after
    finally:
        engine.dispose()
    return keys


# --------------------------------------------------------------------------------------------------- the reads


@dataclass(frozen=True)
class Read:
    page: str  # "tasks" | "cluster": whose p99 target it answers to
    name: str
    path: str
    key: str  # the tenant whose key it is sent with, or the admin token


def page_reads(shape: Shape) -> list[Read]:
    """Every request the tasks page and the cluster page make (api/static/js/pages/tasks.js and cluster.js); `key`
    names the tenant whose key it is sent with, or is the admin token."""
    return [
        Read("tasks", "tasks list, large tenant", "/v1/tasks?limit=50", "tenant-big"),
        Read("tasks", "tasks list, a tenant", "/v1/tasks?limit=50", "tenant-000"),
        Read("tasks", "tenant filter (operator)", "/v1/admin/tenants?limit=100&include_deleted=true", ADMIN_TOKEN),
        Read("tasks", "tasks list, every tenant (operator)", "/v1/tasks?limit=50", ADMIN_TOKEN),
        Read("tasks", "tasks list, large tenant (operator)", "/v1/tasks?limit=50&tenant_id=tenant-big", ADMIN_TOKEN),
        Read("cluster", "cluster", f"/v1/admin/cluster?limit={CLUSTER_WORKERS_SHOWN}", ADMIN_TOKEN),
        Read("cluster", "live packs", "/v1/admin/packs?state=live", ADMIN_TOKEN),
        Read("cluster", "finished packs", "/v1/admin/packs?state=finished&limit=6", ADMIN_TOKEN),
    ]


def status_targets(shape: Shape) -> list[tuple[str, str]]:
    """(tenant, task) pairs the pollers read: finished tasks of every tenant, the running and the queued ones."""
    n, r = shape.tasks, shape.running_tasks
    rng = random.Random(7)
    spread = [rng.randrange(1, n + 1) for _ in range(300)] + [rng.randrange(2 * n + 1, 2 * n + r + QUEUED_TASKS + 1)
                                                              for _ in range(300)]
    out = [(f"tenant-{g % shape.tenants:03d}", f"task-{g:08d}") for g in spread]
    return out + [("tenant-big", f"task-{rng.randrange(n + 1, 2 * n + 1):08d}") for _ in range(100)]


def poll_status(name: str, base_url: str, keys: dict[str, str], targets: list[tuple[str, str]], threads: int,
                rps: float, latencies: Latencies, stop: threading.Event) -> list[threading.Thread]:
    """`threads` pollers reading random tasks' status, `rps` a second in all (as `<name>:status`); started, not
    joined."""
    def loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                tenant, task_id = rng.choice(targets)
                try:
                    r = client.get(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {keys[tenant]}"})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.add(f"{name}:status", time.perf_counter() - started, ok)
                stop.wait(max(0.0, threads / rps - (time.perf_counter() - started)))

    pollers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for thread in pollers:
        thread.start()
    return pollers


def time_reads(sides: list[Side], reads: list[Read], rounds: int, warmup: int, latencies: Latencies) -> None:
    """Each read of each side once a round, the sides alternating which goes first, `warmup` rounds untimed
    first; a failed read stops the run."""
    clients = {side.name: httpx.Client(base_url=side.base_url, timeout=120) for side in sides}
    try:
        for i in range(warmup + rounds):
            for read in reads:
                for side in sides if i % 2 == 0 else sides[::-1]:
                    key = ADMIN_TOKEN if read.key == ADMIN_TOKEN else side.keys[read.key]
                    started = time.perf_counter()
                    r = clients[side.name].get(read.path, headers={"Authorization": f"Bearer {key}"})
                    if r.status_code != 200:
                        raise RuntimeError(f"{side.name}, {read.name}: {r.status_code} {r.text[:500]}")
                    if i >= warmup:
                        latencies.add(f"{side.name}:{read.name}", time.perf_counter() - started, True)
                        latencies.add(f"bytes:{side.name}:{read.name}", len(r.content), True)
    finally:
        for client in clients.values():
            client.close()


# -------------------------------------------------------------------------------------------------- the run


@dataclass
class Side:
    """One API under test: the code of a source tree (this one, or `--baseline`'s) on a database of its own,
    seeded alike."""

    name: str
    root: Path
    database: str = ""
    keys: dict[str, str] = field(default_factory=dict)
    base_url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def prepare(side: Side, shape: Shape, admin_engine: Any, run_id: str) -> dict[str, Any]:
    """The side's database: created, migrated by its own tree (`loraplane migrate`), seeded; what it stores."""
    db = f"loraplane_dash_{run_id}_{side.name}"
    with admin_engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{db}"'))
    side.database = f"{SERVER_URL.rpartition('/')[0]}/{db}"
    subprocess.run([sys.executable, "-m", "loraplane.cli", "migrate"], cwd=side.root, check=True,
                   capture_output=True, env={**os.environ, "DATABASE_URL": side.database})
    t0 = time.perf_counter()
    side.keys = seed(side.database, shape)
    seeded_s = time.perf_counter() - t0
    counts = stored_counts(side.database)
    print(f"{side.name}: seeded in {seeded_s:.0f} s: {counts}", flush=True)
    return {"seed_s": round(seeded_s, 1), "stored": counts}


def start_api(side: Side, workdir: Path, namespace: str) -> None:
    """`loraplane api --workers 2` of the side's tree on its database, with the environment
    benchmarks/cluster_scale.py gives it, in a process group of its own."""
    port = free_port()
    home = workdir / side.name
    env = {**os.environ, "DATABASE_URL": side.database, "REDIS_URL": REDIS_URL, "CELERY_BROKER_URL": REDIS_URL,
           "LORAPLANE_NAMESPACE": namespace, "LORAPLANE_HOME": str(home / "home"),
           "LORAPLANE_ARTIFACT_DIR": str(home / "artifacts"), "LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN,
           "LORAPLANE_SECRET_KEY": Fernet.generate_key().decode(),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    home.mkdir(parents=True, exist_ok=True)
    side.log = home / "api.log"
    side.proc = subprocess.Popen(
        [sys.executable, "-m", "loraplane.cli", "api", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
        env=env, cwd=side.root, stdout=side.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    side.base_url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{side.base_url}/readyz", timeout=5).status_code == 200, 300, f"{side.name}'s API")


def measure(sides: list[Side], shape: Shape, args: argparse.Namespace) -> Latencies:
    """The pages' reads under the status pollers (`--pollers` threads a side); the pollers' reads while the
    APIs warmed up are dropped."""
    latencies, stop = Latencies(), threading.Event()
    pollers = [thread for side in sides for thread in poll_status(
        side.name, side.base_url, side.keys, status_targets(shape), args.pollers, args.status_rps, latencies, stop)]
    try:
        reads = page_reads(shape)
        time_reads(sides, reads, 0, args.warmup, latencies)
        with latencies.lock:
            for side in sides:
                latencies.samples.pop(f"{side.name}:status", None)
                latencies.errors.pop(f"{side.name}:status", None)
        time_reads(sides, reads, args.reads, 0, latencies)
    finally:
        stop.set()
        for thread in pollers:
            thread.join(timeout=120)
    return latencies


def run(shape: Shape, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    sides = [Side("this", ROOT)] + ([Side("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    admin_engine = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    namespace = f"lp-dash-{run_id}"
    try:
        stored = {side.name: prepare(side, shape, admin_engine, run_id) for side in sides}
        for side in sides:
            start_api(side, workdir, f"{namespace}-{side.name}")
        latencies = measure(sides, shape, args)
        if args.hold:
            print(f"APIs at {[s.base_url for s in sides]}; holding for {args.hold} s", flush=True)
            time.sleep(args.hold)
        return {"sides": {side.name: {"root": str(side.root), **stored[side.name]} for side in sides},
                "latencies": latencies}
    except Exception:
        for side in sides:  # the APIs' side of a failed read
            if side.log is not None and side.log.exists():
                print(f"--- {side.name}'s API\n{side.log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for side in sides:
            if side.proc is not None and side.proc.poll() is None:
                os.killpg(side.proc.pid, signal.SIGKILL)
                side.proc.wait(timeout=30)
        with admin_engine.connect() as conn:
            for side in sides:
                if side.database:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{side.database.rpartition("/")[2]}" WITH (FORCE)'))
        admin_engine.dispose()
        for side in sides:
            forget_namespace(f"{namespace}-{side.name}")


def stored_counts(database_url: str) -> dict[str, int]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return {table: int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
                    for table in ("tenants", "tasks", "trials", "metric_points", "workers", "packs", "trial_usage")}
    finally:
        engine.dispose()


HEADERS = ["page", "request", "code", "p50 ms", "p99 ms", "reads", "KB", "target p99 ms"]


def table_rows(shape: Shape, names: list[str], latencies: Latencies) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for read in page_reads(shape):
        for name in names:
            p50, p99, n = latencies.quantiles_ms(f"{name}:{read.name}")
            size = latencies.samples.get(f"bytes:{name}:{read.name}", [0])
            rows.append([read.page, read.name, name, p50, p99, n, round(max(size) / 1024, 1), TARGETS_MS[read.page]])
    for name in names:
        p50, p99, n = latencies.quantiles_ms(f"{name}:status")
        rows.append(["status", "task status (pollers, concurrent)", name, p50, p99, n, None, TARGETS_MS["status"]])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=10_000, help="finished tasks over the tenants, and as many "
                                                                  "again for the large tenant")
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--trials-per-task", type=int, default=4)
    parser.add_argument("--points-per-trial", type=int, default=20)
    parser.add_argument("--reads", type=int, default=60, help="timed rounds (each request once a round)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pollers", type=int, default=4)
    parser.add_argument("--status-rps", type=float, default=20.0)
    parser.add_argument("--label", default="", help="in the result's name: dashboard_scale-<label>-cpu-<date>.json")
    parser.add_argument("--baseline", default=None, help="a source tree (e.g. `git archive` of an earlier commit) "
                        "to measure side by side: its API on a database of its own, seeded alike, the reads "
                        "alternating between the two")
    parser.add_argument("--hold", type=float, default=0.0, help="keep the API up this long after the reads "
                                                                "(to profile it), then clean up")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run still drops its database
    shape = Shape(tasks=args.tasks, workers=args.workers, tenants=args.tenants, trials_per_task=args.trials_per_task,
                  points_per_trial=args.points_per_trial)
    with tempfile.TemporaryDirectory(prefix="dashboard-scale-") as tmp:
        result = run(shape, args, Path(tmp))
    latencies: Latencies = result.pop("latencies")
    names = list(result["sides"])
    rows = table_rows(shape, names, latencies)
    worst = {name: {page: max((r[4] for r in rows if r[0] == page and r[2] == name), default=None)
                    for page in TARGETS_MS} for name in names}
    write_result("dashboard_scale" + (f"-{args.label}" if args.label else ""), HEADERS, rows, {
        "shape": shape.__dict__ | {"running_tasks": shape.running_tasks, "queued_tasks": QUEUED_TASKS,
                                   "finished_packs": finished_packs(shape), "pack_slots": SLOTS},
        **result, "errors": latencies.errors, "p99_ms_by_page": worst, "targets_p99_ms": TARGETS_MS,
        "met": {page: (p99 := worst["this"][page]) is not None and p99 <= TARGETS_MS[page] for page in TARGETS_MS},
        "status_rps_per_side": args.status_rps, "pollers_per_side": args.pollers, "baseline": args.baseline,
    })


if __name__ == "__main__":
    main()
