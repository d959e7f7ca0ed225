"""How fast the scheduler moves loss points from the bus into Postgres, by the size of the batches
workers send (the Reporter batches up to 500 points or 0.5 s). Runs the real daemon loop
(consume -> ingest in one transaction -> ack -> tick) against real Redis and PostgreSQL.

    DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/0 \
        .venv/bin/python -m benchmarks.ingest
"""

from __future__ import annotations

import os
import time
import uuid

from sqlalchemy import create_engine, text

SERVER_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
RUN = uuid.uuid4().hex[:8]
DB = f"loraplane_bench_{RUN}"
os.environ.update({"DATABASE_URL": SERVER_URL.rsplit("/", 1)[0] + f"/{DB}", "REDIS_URL": REDIS_URL,
                   "LORAPLANE_NAMESPACE": f"lp-bench-{RUN}", "LORAPLANE_HOME": f"/tmp/lp-bench-{RUN}"})

POINTS = 20_000
TRIALS = 8
BATCH_SIZES = (1, 20, 100, 500)


def setup() -> str:
    from common import states
    from common.db import migrate, session_scope
    from common.registry import ensure_default_models
    from common.tables import File, Pack, Task, Tenant, Trial, new_id

    migrate()
    with session_scope() as s:
        ensure_default_models(s)
        tenant = Tenant(id=new_id("ten"), name="bench", max_concurrent_trials=100, max_trials_per_task=100,
                        max_file_bytes=1)
        s.add(tenant)
        s.flush()
        file = File(id=new_id("file"), tenant_id=tenant.id, filename="f", bytes=1, rows=1, format="messages",
                    sha256="", storage_key="")
        s.add(file)
        s.flush()
        task = Task(id=new_id("task"), tenant_id=tenant.id, base_model="tiny-random-llama",
                    training_file_id=file.id, state=states.TASK_RUNNING, spec={"eval_interval": 10})
        s.add(task)
        s.flush()
        pack = Pack(id=new_id("pack"), worker_id="bench", base_model="tiny-random-llama",
                    state=states.PACK_RUNNING, trial_ids=[])
        s.add(pack)
        for i in range(TRIALS):
            s.add(Trial(id=f"trial-bench-{i}", task_id=task.id, tenant_id=tenant.id, index=i,
                        state=states.TRIAL_RUNNING, hyperparameters={}, total_steps=10**9, pack_id=pack.id))
        return pack.id


def run(pack_id: str) -> list[list[object]]:
    from common.bus import SCHEDULER_STREAM, get_bus
    from common.celery import get_celery
    from common.messages import Point, Points
    from common.settings import get_settings
    from scheduler.service.daemon import SchedulerDaemon

    bus = get_bus()
    daemon = SchedulerDaemon(get_settings(), bus, get_celery())
    rows: list[list[object]] = []
    step0 = 0
    base_rate = None
    for batch in BATCH_SIZES:
        points = [Point(f"trial-bench-{i % TRIALS}", step0 + i // TRIALS, "train", 1.0) for i in range(POINTS)]
        step0 += POINTS
        for start in range(0, POINTS, batch):
            report = Points(pack_id=pack_id, worker_id="bench", points=points[start:start + batch])
            bus.publish(SCHEDULER_STREAM, report.to_dict())
        t0 = time.perf_counter()
        while daemon.step(block_s=0.01):
            pass
        elapsed = time.perf_counter() - t0
        rate = POINTS / elapsed
        base_rate = base_rate or rate
        rows.append([batch, POINTS // batch, round(elapsed, 3), round(rate), round(rate / base_rate, 1)])
    return rows


def main() -> None:
    from benchmarks.common import write_result

    admin = create_engine(SERVER_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{DB}"'))
    try:
        rows = run(setup())
        from common.db import get_engine

        get_engine().dispose()
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)'))
    write_result(
        "ingest",
        ["points/message", "messages", "seconds", "points/s", "vs 1/message"],
        rows,
        {"points_per_run": POINTS, "trials": TRIALS,
         "what": "scheduler daemon loop, Redis stream -> PostgreSQL, one transaction per consumed batch"},
    )


if __name__ == "__main__":
    main()
